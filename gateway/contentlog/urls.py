from django.urls import path

from gateway.contentlog import views

app_name = "breakglass"
urlpatterns = [
    path("", views.index, name="index"),
    path("<int:grant_id>/read/", views.read, name="read"),
]

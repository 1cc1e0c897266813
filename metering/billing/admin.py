from django.contrib import admin

from metering.billing.models import AlertEvent, ExportJob, Price, SpendAlert


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    list_display = ("model_name", "effective_from", "currency", "input_per_mtok",
                    "cached_input_per_mtok", "output_per_mtok")
    list_filter = ("currency", "model_name")


@admin.register(SpendAlert)
class SpendAlertAdmin(admin.ModelAdmin):
    list_display = ("tenant", "api_key", "metric", "period", "threshold", "hard_cap", "enabled",
                    "last_fired_period")
    list_filter = ("metric", "period", "hard_cap", "enabled")
    list_select_related = ("tenant", "api_key")  # nullable: Django would not join it itself
    raw_id_fields = ("tenant", "api_key", "created_by")


@admin.register(AlertEvent)
class AlertEventAdmin(admin.ModelAdmin):
    list_display = ("alert", "period", "value", "emailed", "webhook_status", "suspended",
                    "fired_at")
    list_select_related = ("alert__tenant", "alert__api_key")  # the alert's name shows both


@admin.register(ExportJob)
class ExportJobAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "start", "end", "format", "status", "rows_done", "rows_total",
                    "created_at")
    list_filter = ("status", "format")
    list_select_related = ("tenant",)

# ContentLoggingChange and ManagementToken move here from the portal app with their tables
# (state only: the tables keep their names and rows); StaffGrant and Invitation are new.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0003_identity_providers_client_certs_retention'),
        ('portal', '0001_initial'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ContentLoggingChange',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('enabled', models.BooleanField()),
                        ('changed_at', models.DateTimeField(auto_now_add=True)),
                        ('remote_addr', models.GenericIPAddressField(blank=True, null=True)),
                        ('changed_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'portal_contentloggingchange',
                        'ordering': ['-changed_at', '-id'],
                    },
                ),
                migrations.CreateModel(
                    name='ManagementToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100)),
                        ('role', models.CharField(choices=[('owner', 'Owner'), ('member', 'Member'), ('billing', 'Billing')], default='billing', max_length=16)),
                        ('key_hash', models.CharField(editable=False, max_length=64, unique=True)),
                        ('pepper_version', models.PositiveSmallIntegerField(editable=False)),
                        ('prefix', models.CharField(editable=False, max_length=24)),
                        ('last_four', models.CharField(editable=False, max_length=4)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('expires_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('created_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'portal_managementtoken',
                        'ordering': ['-created_at'],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]

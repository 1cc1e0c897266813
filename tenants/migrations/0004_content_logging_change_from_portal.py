# The content-logging audit trail moved from the portal app to tenants, where the switch that
# writes it lives. The table keeps its name: only Django's model state moves.

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
                        'ordering': ['-changed_at', '-id'],
                        'db_table': 'portal_contentloggingchange',
                    },
                ),
            ],
            database_operations=[],
        ),
    ]

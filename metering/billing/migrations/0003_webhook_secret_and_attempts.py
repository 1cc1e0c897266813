import metering.billing.models
import secrets

from django.db import migrations, models


def _give_secrets(apps, schema_editor):
    # Alerts made before deliveries were signed: each gets its own secret (shown in the admin).
    SpendAlert = apps.get_model('billing', 'SpendAlert')
    for alert in SpendAlert.objects.exclude(webhook_url='').filter(webhook_secret=''):
        alert.webhook_secret = 'whsec_' + secrets.token_urlsafe(32)
        alert.save(update_fields=['webhook_secret'])


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0002_alert_currency'),
    ]

    operations = [
        migrations.AddField(
            model_name='spendalert',
            name='webhook_secret',
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.AlterField(
            model_name='spendalert',
            name='webhook_url',
            field=models.URLField(blank=True, help_text='Optional: an https URL POSTed a signed JSON body on firing.', validators=[metering.billing.models.validate_webhook_url]),
        ),
        migrations.AddField(
            model_name='alertevent',
            name='webhook_attempts',
            field=models.PositiveSmallIntegerField(default=0),
        ),
        migrations.RunPython(_give_secrets, migrations.RunPython.noop),
    ]

# The setting column: one audit table for the content-storing opt-ins.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0012_catalog_moves_out'),
    ]

    operations = [
        migrations.AddField(
            model_name='contentloggingchange',
            name='setting',
            field=models.CharField(choices=[('content_logging', 'content logging'), ('response_cache', 'response cache')], default='content_logging', max_length=16),
        ),
    ]

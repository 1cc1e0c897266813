# The content-logging audit trail moved to tenants (tenants 0004); its table stays.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('portal', '0001_initial'),
        ('tenants', '0004_content_logging_change_from_portal'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name='ContentLoggingChange')],
            database_operations=[],
        ),
    ]

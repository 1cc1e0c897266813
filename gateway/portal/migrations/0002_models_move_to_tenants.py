# The portal's models now belong to ``tenants`` (one home for tenant services). The tables are
# unchanged: the models there keep these table names, so no row moves.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('portal', '0001_initial'),
        ('tenants', '0004_portal_models_and_access'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='ContentLoggingChange'),
                migrations.DeleteModel(name='ManagementToken'),
            ],
            database_operations=[],
        ),
    ]

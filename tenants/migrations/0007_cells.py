# Cells (docs/adr/0019): a tenant's home and extra cells, a pool's cell.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0006_servedmodel_tool_call_parser_task"),
    ]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="cell",
            field=models.CharField(
                blank=True, default="", max_length=64,
                help_text="The cell whose Redis and workers host this pool (docs/adr/0019). "
                          "Blank: any gateway may route here (a deployment without cells).",
            ),
        ),
        migrations.AddField(
            model_name="tenant",
            name="home_cell",
            field=models.CharField(
                blank=True, default="", max_length=64,
                help_text="The cell that serves this tenant. Blank: the deployment's default "
                          "cell.",
            ),
        ),
        migrations.AddField(
            model_name="tenant",
            name="extra_cells",
            field=models.CharField(
                blank=True, default="", max_length=255,
                help_text="Comma-separated cells that also serve this tenant; its token quota "
                          "is then split across the home and these cells by recent demand.",
            ),
        ),
    ]

# The pool catalog (ServedModel, Pool, Route, RouteTarget) now belongs to ``catalog``
# (docs/adr/0030-catalog-package.md). The tables are unchanged: the models there keep these
# table names, so no row moves. Tenants' own relations point at the catalog's models; the
# columns and constraints already reference the same tables, so only the state changes.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0011_apikey_rotated_at'),
        ('catalog', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='quota',
                    name='model',
                    field=models.ForeignKey(blank=True, help_text="Empty = the tenant's default quota for every model.", null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='catalog.servedmodel'),
                ),
                migrations.AlterField(
                    model_name='apikey',
                    name='allowed_models',
                    field=models.ManyToManyField(blank=True, help_text='Empty = every model the tenant may use.', related_name='+', to='catalog.servedmodel'),
                ),
                migrations.AlterField(
                    model_name='project',
                    name='allowed_models',
                    field=models.ManyToManyField(blank=True, help_text='Empty = every model the tenant may use. A key in the project uses the models both it and its project allow.', related_name='+', to='catalog.servedmodel'),
                ),
                migrations.DeleteModel(name='RouteTarget'),
                migrations.DeleteModel(name='Route'),
                migrations.DeleteModel(name='Pool'),
                migrations.DeleteModel(name='ServedModel'),
            ],
            database_operations=[],
        ),
    ]

# The pool catalog moves out of ``tenants`` (docs/adr/0030-catalog-package.md). Its tables were
# made by tenants' migrations and keep their names (``db_table``), so this migration only
# records the models in the new app's state: no table is created, altered or copied. On an
# existing database the content types are renamed too, so permissions (``change_pool``) and
# the admin's history follow the models; on a new one they do not exist yet.

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models

MOVED = ("servedmodel", "pool", "route", "routetarget")


def _relabel(apps, source, target):
    content_type = apps.get_model("contenttypes", "ContentType")
    present = content_type.objects.filter(app_label=target).values_list("model", flat=True)
    content_type.objects.filter(app_label=source, model__in=MOVED).exclude(
        model__in=list(present)).update(app_label=target)


def forwards(apps, schema_editor):
    _relabel(apps, "tenants", "catalog")


def backwards(apps, schema_editor):
    _relabel(apps, "catalog", "tenants")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('contenttypes', '0002_remove_content_type_name'),
        ('tenants', '0011_apikey_rotated_at'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ServedModel',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.SlugField(help_text='Name tenants pass as `model`.', max_length=128, unique=True)),
                        ('engine_model_id', models.CharField(help_text='Model path or id for the engine.', max_length=255)),
                        ('tokenizer_path', models.CharField(blank=True, help_text='Directory with tokenizer.json (and chat template); empty = the built-in sim model.', max_length=500)),
                        ('max_model_len', models.PositiveIntegerField(default=8192, validators=[django.core.validators.MinValueValidator(16)])),
                        ('tool_call_parser', models.CharField(choices=[('hermes', 'Hermes <tool_call> JSON (Qwen, Hermes)'), ('llama3_json', 'Llama 3 JSON'), ('mistral', 'Mistral [TOOL_CALLS]')], default='hermes', help_text='How this model writes tool calls (parsed for tool_choice auto).', max_length=32)),
                        ('task', models.CharField(choices=[('generate', 'Text generation (chat, completions)'), ('embed', 'Embeddings (/v1/embeddings)')], default='generate', help_text='What the model serves; vLLM pools of an embedding model run its pooling runner.', max_length=16)),
                        ('num_layers', models.PositiveIntegerField(default=32, validators=[django.core.validators.MinValueValidator(1)])),
                        ('num_kv_heads', models.PositiveIntegerField(default=8, validators=[django.core.validators.MinValueValidator(1)])),
                        ('head_dim', models.PositiveIntegerField(default=128, validators=[django.core.validators.MinValueValidator(1)])),
                        ('bytes_per_value', models.PositiveSmallIntegerField(default=2, validators=[django.core.validators.MinValueValidator(1)])),
                        ('parameter_count', models.BigIntegerField(default=8000000000, help_text='Used by the capacity planner to size the weights.', validators=[django.core.validators.MinValueValidator(1)])),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'verbose_name': 'model',
                        'db_table': 'tenants_servedmodel',
                        'ordering': ['name'],
                    },
                ),
                migrations.CreateModel(
                    name='Pool',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.SlugField(max_length=64, unique=True)),
                        ('region', models.CharField(default='local', max_length=64)),
                        ('backend', models.CharField(choices=[('simulated', 'Simulated engine'), ('vllm', 'vLLM (in-process AsyncLLM)'), ('openai_upstream', 'OpenAI-compatible upstream server')], default='simulated', max_length=32)),
                        ('backend_settings', models.JSONField(blank=True, default=dict, help_text='Backend-specific settings (rates, URLs, engine args).')),
                        ('max_sequences', models.PositiveIntegerField(default=64, help_text='Running sequences per engine instance.', validators=[django.core.validators.MinValueValidator(1)])),
                        ('kv_cache_tokens', models.PositiveIntegerField(default=381000, help_text='Tokens of KV cache per engine instance.', validators=[django.core.validators.MinValueValidator(16)])),
                        ('kv_overcommit', models.FloatField(default=1.0, help_text='Dispatch while reserved KV tokens stay under capacity x overcommit.', validators=[django.core.validators.MinValueValidator(0.1)])),
                        ('enabled', models.BooleanField(default=True)),
                        ('cell', models.CharField(blank=True, default='', help_text='The cell whose Redis and workers host this pool (docs/adr/0019). Blank: any gateway may route here (a deployment without cells).', max_length=64)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('dedicated_to', models.ForeignKey(blank=True, help_text="Empty = shared pool. Set = only this tenant's requests are routed here.", null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='dedicated_pools', to='tenants.tenant')),
                        ('model', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='pools', to='catalog.servedmodel')),
                    ],
                    options={
                        'db_table': 'tenants_pool',
                        'ordering': ['name'],
                    },
                ),
                migrations.CreateModel(
                    name='Route',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(help_text='The public model name clients send.', max_length=200, unique=True)),
                        ('retries', models.PositiveSmallIntegerField(blank=True, help_text='Attempts on other targets after a retryable failure before the first token (empty: the ROUTE_RETRIES setting).', null=True, validators=[django.core.validators.MaxValueValidator(5)])),
                        ('fallbacks', models.JSONField(blank=True, default=list, help_text='Public model names to fall back to, in order, e.g. ["small-model"].')),
                        ('enabled', models.BooleanField(default=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'tenants_route',
                        'ordering': ['name'],
                    },
                ),
                migrations.CreateModel(
                    name='RouteTarget',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('weight', models.FloatField(default=1.0, validators=[django.core.validators.MinValueValidator(0.001)])),
                        ('priority', models.PositiveSmallIntegerField(default=0, help_text='Lower is tried first; a higher one only when every lower one is unhealthy, overloaded or failed.')),
                        ('pool', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='route_targets', to='catalog.pool')),
                        ('route', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='targets', to='catalog.route')),
                    ],
                    options={
                        'db_table': 'tenants_routetarget',
                        'ordering': ['route', 'priority', 'pool__name'],
                        'constraints': [models.UniqueConstraint(fields=('route', 'pool'), name='route_target_once')],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(forwards, backwards),
    ]

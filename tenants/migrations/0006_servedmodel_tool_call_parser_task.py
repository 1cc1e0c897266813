from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0005_staff_grants_invitations"),
    ]

    operations = [
        migrations.AddField(
            model_name="servedmodel",
            name="tool_call_parser",
            field=models.CharField(
                choices=[("hermes", "Hermes <tool_call> JSON (Qwen, Hermes)"),
                         ("llama3_json", "Llama 3 JSON"), ("mistral", "Mistral [TOOL_CALLS]")],
                default="hermes",
                help_text="How this model writes tool calls (parsed for tool_choice auto).",
                max_length=32,
            ),
        ),
        migrations.AddField(
            model_name="servedmodel",
            name="task",
            field=models.CharField(
                choices=[("generate", "Text generation (chat, completions)"),
                         ("embed", "Embeddings (/v1/embeddings)")],
                default="generate",
                help_text="What the model serves; vLLM pools of an embedding model run its "
                          "pooling runner.",
                max_length=16,
            ),
        ),
    ]

from django.db import migrations, models


def keys_from_log_paths(apps, schema_editor):
    """Instances made before the key was a field: it was the stem of the log file's name."""
    Instance = apps.get_model("deployments", "Instance")
    for instance in Instance.objects.filter(key="").exclude(log_path=""):
        key = instance.log_path.rsplit("/", 1)[-1].removesuffix(".log")
        Instance.objects.filter(pk=instance.pk).update(key=key[:100])


class Migration(migrations.Migration):

    dependencies = [
        ('deployments', '0002_downloads'),
    ]

    operations = [
        migrations.AddField(
            model_name='instance',
            name='key',
            field=models.CharField(blank=True, help_text="the host's name for this engine process", max_length=100),
        ),
        migrations.AddField(
            model_name='instance',
            name='claim_bytes',
            field=models.BigIntegerField(blank=True, help_text='GPU memory per GPU it was launched to use', null=True),
        ),
        migrations.RunPython(keys_from_log_paths, migrations.RunPython.noop),
    ]

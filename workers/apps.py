from django.apps import AppConfig

from tenants import pool_settings, pool_status


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Serving workers"

    def ready(self) -> None:
        from serving.wfq import Wfq
        from workers.engine.registry import check_pool_settings

        pool_settings.register(check_pool_settings)
        pool_status.register_backlog(lambda client, pool: Wfq(client).backlog(pool))

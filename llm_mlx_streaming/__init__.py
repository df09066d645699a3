"""llm plugin hooks: the ``mlx-stream`` models and the ``llm mlxs`` commands.

Only hooks live here. Every ``llm`` command imports every plugin, so nothing
heavy (mlx, mlx_lm, the engine) is imported at module level: ``llm --help``
stays fast, and a broken settings file never breaks unrelated llm commands.
"""

import llm
from .errors import SettingsError
from .plugin.logs_db import prepare_logs_db


@llm.hookimpl
def register_models(register):
    from .plugin.async_model import MlxStreamAsyncModel
    from .plugin.model import MlxStreamModel
    from .options.knobs import BUNDLED_NAME
    from .options.settings import load_settings

    # Each id has a sync and an async model; both share the one engine.
    register(MlxStreamModel(), MlxStreamAsyncModel())
    register(MlxStreamModel(BUNDLED_NAME), MlxStreamAsyncModel(BUNDLED_NAME))
    try:
        settings = load_settings()
    except SettingsError:
        return  # `-m mlx-stream` (and `llm mlxs`) report the file problem
    for name, entry in settings.models.items():
        register(MlxStreamModel(name), MlxStreamAsyncModel(name), aliases=tuple(entry.aliases))


@llm.hookimpl
def register_commands(cli):
    from .cli import register

    register(cli)
    prepare_logs_db()  # before any command: llm's first prompts race in its migrations

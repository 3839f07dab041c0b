"""Serving pooling models (embedding, rerank, classification) beside the generation engine:
`engine_from_settings` builds the engine the served model needs (engine/pooling/engine.py for a
pooling model, the generation engine for any other)."""

from __future__ import annotations

from opentgi.config import Settings


def engine_from_settings(settings: Settings, observer=None):
    from opentgi.models.pooling.loading import pooling_folder_of

    folder = pooling_folder_of(settings)
    if folder is None:
        from opentgi.engine.engine import Engine

        return Engine.from_settings(settings, observer=observer)
    from opentgi.engine.pooling.engine import PoolingEngine

    return PoolingEngine.from_settings(settings, folder, observer=observer)

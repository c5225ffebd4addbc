"""The sweep's one training engine at a time: a checkpoint is loaded once per engine and dtype, and a variant of
the same dtype switches the loaded model's options in place (`TrainingEngine.reconfigure`) wherever the engine
can; only where it cannot is a new engine built."""

from __future__ import annotations

from mismatch_probe.engines import training_engine
from mismatch_probe.engines.base import EngineConfig, TrainingEngine
from mismatch_probe.engines.peak import free_memory
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.pipeline.sweep.knobs import Setting


class LoadedEngine:
    def __init__(self, engine: str, batch_size: int):
        self.name, self.batch_size = engine, batch_size
        self.engine: TrainingEngine | None = None
        self.setting: Setting | None = None
        self.builds = 0  # engines built: each loads the checkpoint
        self.reconfigured = 0  # settings switched on a loaded model instead

    def get(self, setting: Setting, model: ModelInfo) -> TrainingEngine:
        """The engine for `setting` on `model`: the loaded one, reconfigured if need be, or a new one."""
        current = self.engine
        if current is not None and self.setting.dtype == setting.dtype and current.model.path == model.path:
            if self.setting.engine_args == setting.engine_args:
                return current
            if current.reconfigure(dict(setting.engine_args)):
                self.setting, self.reconfigured = setting, self.reconfigured + 1
                return current
        del current  # no reference left to the old engine, so that close frees it before the new one loads
        self.close()  # one checkpoint in memory at a time
        config = EngineConfig(dtype=setting.dtype, batch_size=self.batch_size, engine_args=dict(setting.engine_args))
        self.engine, self.setting = training_engine(self.name, model, config), setting
        self.builds += 1
        return self.engine

    def close(self) -> None:
        """Drop the loaded engine and give its memory back before anything else loads."""
        held = self.engine is not None
        if held:
            self.engine.close()
        self.engine, self.setting = None, None
        if held:
            free_memory()

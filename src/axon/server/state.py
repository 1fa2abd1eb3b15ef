"""What every route can reach: the config, the model registry, process-wide status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class AppState:
    config: object  # axon.server.config.ServerConfig
    registry: object  # axon.server.lifecycle.registry.ModelRegistry
    started_at: float = field(default_factory=time.time)
    activation: object | None = None  # the default-models activation tracker
    shutting_down: bool = False

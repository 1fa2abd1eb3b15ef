"""neuron's NEURON_DEBUG_POISON, and a wedge, for the fault tests: when AXON_DEBUG_POISON (or
_WEDGE, _TP_WEDGE) names a model, its first request in this process injects a device fault (or
a step that never returns, or a hung tensor-parallel rank), so tests can drive poisoning, the
watchdog and recovery end to end against a real engine."""

from __future__ import annotations

import os

_DEBUG_HOOKS = {
    "AXON_DEBUG_POISON": "inject_fault",
    "AXON_DEBUG_WEDGE": "inject_hang",
    "AXON_DEBUG_TP_WEDGE": "inject_tp_wedge",  # rank 1 of a tensor-parallel engine hangs
}
_FIRED: set[tuple[str, str]] = set()


async def fire_debug_hooks(model_id: str, client) -> None:
    """Sends the fault command each hook naming `model_id` asks for, once per process."""
    for variable, command in _DEBUG_HOOKS.items():
        if os.environ.get(variable) == model_id and (variable, model_id) not in _FIRED:
            _FIRED.add((variable, model_id))
            await client.call(command)

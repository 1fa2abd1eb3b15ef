"""The messages between the HTTP process and an engine process: the whole protocol.

The HTTP process's EngineClient (client.py) and the engine's EngineLoop (engine_proc.py) talk over
one multiprocessing Pipe (a socketpair). Each message is one of the types below, sent as one
frame (`Connection.send_bytes`, read back by `Connection.recv_bytes` or pipe_reader.PipeReader)
that holds `encode(message)`; `decode` rebuilds it. Receivers dispatch on the type (`match`).

To the engine (from the client's writer thread):

    AddRequest(request_id, prompt_token_ids, params, images)
                                    queue a request; its TokenUpdates come back in Updates,
                                    or a Failed names it (a bad request, a failed step)
    Abort(request_ids)              finish these requests now; nothing comes back
    StopSample(request_id, index)   finish one sample now; nothing comes back
    Call(call_id, command, args)    run one of COMMANDS; answered by one Reply(call_id, ...)

From the engine, while it loads:

    LoadProgress(loaded_bytes, total_bytes)   any number of them, then one of
    Ready(info)                               weights resident: the loop below starts
    LoadFailed(error)                         and the engine process exits

then, until it exits:

    Updates(updates)             one step's TokenUpdates, one per sample the step scheduled
                                 (several for a sample whose drafts were accepted: one a token)
    Failed(request_ids, error, refused)
                                 these requests end with this error; nothing more comes for them
                                 (refused: the request itself was invalid for this engine)
    Reply(call_id, ok, payload)  a Call's result (ok) or its error's text (not ok)
    Poisoned(error)              a device fault: the engine only drains from now on, every
                                 message but Call("shutdown") fails
    Heartbeat()                  nothing else was sent for a heartbeat: the engine is alive
                                 (silence past the step deadline means a wedged engine)

This module imports only the standard library and axon.outputs: the HTTP process imports it
before torch, and decoding a message imports nothing. A message crosses as a plain tuple, its
type's tag first, then its fields, pickled: pickled as themselves, the classes' module paths
would be written and looked up by name on both ends of every message. Updates, sent every step,
is its rows alone: a list of TokenUpdates (NamedTuples, so each is its own row) with logprobs as
plain tuples, rebuilt as WireLogprobs (the engine's are axon.sampling.TokenLogprobs, whose
unpickling would import torch); a sample's prompt logprobs, on its first token's update, are
plain tuples of the same fields already. The message types are slots dataclasses, not frozen
ones, which cost twice as much to make, and one Updates is made on each end every step. The
costs against positional tuples: benchmarks/engine_messages.py, docs/performance.md ("Typed
engine messages").
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from axon.outputs import TokenUpdate

if TYPE_CHECKING:
    from axon.sampling_params import SamplingParams

# What a Call may run, each by EngineLoop._cmd_<name>(*args); the reply's payload is described.
COMMANDS = {
    "shutdown": "None; the loop ends and the engine frees what it owns (even when poisoned)",
    "memory": "(free, total) bytes of the device; (0, 0) off CUDA",
    "stats": "the scheduler's and the prefix cache's counters (EngineCore.stats)",
    "clear_caches": "None; the prefix cache (and CUDA's cached blocks) are dropped",
    "forward_logits": "(prompts) each prompt's last-position logits as a list; engine idle only",
    "encode_image": "(pixel_values, grid_thw) the vision tower's output rows as lists",
    "inject_fault": "None; debug: the next step raises a device fault",
    "inject_hang": "None; debug: the next step never returns",
    "inject_tp_wedge": "None; debug: tensor-parallel rank 1 blocks forever in the next step",
    "inject_step_error": "None; debug: the next forward raises a plain (not device) error",
}


class Message:
    """Base of every message type."""

    __slots__ = ()


# ---- to the engine --------------------------------------------------------------------------


@dataclass(slots=True)
class AddRequest(Message):
    """Queue a request of `params.n` samples. `images`: {"pixel_values", "grid_thw"} prepared
    by the HTTP process, for a prompt whose image placeholders are expanded."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: dict | None = None


@dataclass(slots=True)
class Abort(Message):
    """Finish these requests now and free their blocks (unknown ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class StopSample(Message):
    """Finish sample `index` of a request now: the frontend matched a stop string."""

    request_id: str
    index: int


@dataclass(slots=True)
class Call(Message):
    """Run COMMANDS[`command`] with `args`; the engine answers with Reply(call_id, ...)."""

    call_id: int
    command: str
    args: tuple = ()


# ---- from the engine ------------------------------------------------------------------------


@dataclass(slots=True)
class LoadProgress(Message):
    """Bytes of weights loaded so far, of `total_bytes`."""

    loaded_bytes: int
    total_bytes: int


@dataclass(slots=True)
class Ready(Message):
    """Weights are resident; `info` describes the engine (engine_proc.engine_info)."""

    info: dict


@dataclass(slots=True)
class LoadFailed(Message):
    """Loading failed ("ExceptionType: message"); the engine process exits."""

    error: str


@dataclass(slots=True)
class Updates(Message):
    """One step's TokenUpdates; in the HTTP process their logprobs are WireLogprobs."""

    updates: list[TokenUpdate]


@dataclass(slots=True)
class Failed(Message):
    """These requests end with `error`. `refused`: the engine would not take the request as
    sent (a ValueError while adding it, e.g. structured output this model's tokenizer cannot
    do): the client's fault, not the engine's."""

    request_ids: list[str]
    error: str
    refused: bool = False


@dataclass(slots=True)
class Reply(Message):
    """The answer to Call `call_id`: its result when `ok`, else its error's text."""

    call_id: int
    ok: bool
    payload: Any


@dataclass(slots=True)
class Poisoned(Message):
    """A device fault (`error`): every message but Call("shutdown") fails from now on."""

    error: str


@dataclass(slots=True)
class Heartbeat(Message):
    """Nothing else was sent for a heartbeat."""


class WireLogprobs(NamedTuple):
    """A token's logprobs as the HTTP process holds them: axon.sampling.TokenLogprobs's fields,
    without importing the sampler (torch)."""

    token_id: int
    logprob: float
    rank: int
    top: list  # [(token_id, logprob)] the most likely first


# ---- the encoding ---------------------------------------------------------------------------


class MalformedMessage(ValueError):
    """Decoded bytes that are no message of this protocol."""


# A tag is the type's index here. Updates has none: it is the one message encoded as a list.
_TYPES = (
    AddRequest,
    Abort,
    StopSample,
    Call,
    LoadProgress,
    Ready,
    LoadFailed,
    Failed,
    Reply,
    Poisoned,
    Heartbeat,
)
_TAG = {cls: tag for tag, cls in enumerate(_TYPES)}
_LOGPROBS = TokenUpdate._fields.index("logprobs")
_new = tuple.__new__  # of a NamedTuple from its fields' tuple, without a Python call


def _fields_getter(cls) -> Callable[[Message], tuple]:
    """A function of a `cls` message that returns its fields' values in order."""
    names = [field.name for field in dataclasses.fields(cls)]
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        get = operator.attrgetter(names[0])
        return lambda message: (get(message),)
    return lambda message: ()


_FIELDS = {cls: _fields_getter(cls) for cls in _TYPES}


def _row(update: TokenUpdate) -> tuple:
    """An update with logprobs as it crosses: a plain tuple, its logprobs one too."""
    lp = update.logprobs
    plain = (lp.token_id, lp.logprob, lp.rank, lp.top)
    return (*update[:_LOGPROBS], plain, *update[_LOGPROBS + 1 :])


def _update(row: tuple) -> TokenUpdate:
    """The update a row with logprobs came from, its logprobs a WireLogprobs."""
    fields = list(row)
    fields[_LOGPROBS] = _new(WireLogprobs, fields[_LOGPROBS])
    return _new(TokenUpdate, fields)


def encode(message: Message) -> bytes:
    """`message` as the bytes of one frame. Raises TypeError for what is no message, and what
    pickling its fields raises."""
    cls = type(message)
    if cls is Updates:
        wire = [tuple(u) if u.logprobs is None else _row(u) for u in message.updates]
    else:
        try:
            fields = _FIELDS[cls]
        except KeyError:
            raise TypeError(f"not an engine message: {message!r}") from None
        wire = (_TAG[cls], *fields(message))
    return pickle.dumps(wire, pickle.HIGHEST_PROTOCOL)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message `encode` made `data` from. Raises MalformedMessage for a pickle that is no
    message, and what unpickling raises. Rows of Updates are not checked: both ends are one
    build of this module."""
    wire = pickle.loads(data)
    if type(wire) is list:
        return Updates([_new(TokenUpdate, r) if r[_LOGPROBS] is None else _update(r) for r in wire])
    try:
        if type(wire) is not tuple or not 0 <= wire[0] < len(_TYPES):
            raise ValueError(f"{wire!r:.80}")
        return _TYPES[wire[0]](*wire[1:])
    except (TypeError, IndexError, ValueError) as exc:
        raise MalformedMessage(f"not an engine message: {exc}") from exc

"""A site of your own PyTorch (or NumPy) model: ``estuary.Client(...).run(fit)``.

The C++ agent under it (include/estuary/client.h, estuary::RunSite) does the
mutual TLS, the framing, the streaming of the model and the update, the
heartbeats, the checksums and the reconnects; Python sees arrays. The GIL is
released while the agent works and taken only to call ``fit``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _estuary
from ._model_files import StateDict, as_float32, dtype_name, model_name

FitResult = Union[Tuple[Mapping[str, Any], int], Tuple[Mapping[str, Any], int, Mapping[str, float]]]
"""What ``fit`` returns: (new weights by name, the examples trained on[, metrics such as {"loss": ...}])."""

FitFunction = Callable[[Dict[str, np.ndarray], Dict[str, Any]], FitResult]
"""``fit(weights, config)``: weights are read-only float32 arrays by name; config holds the round's task."""

EvaluateResult = Union[Tuple[float, int], Tuple[float, int, Mapping[str, float]]]
"""What ``evaluate`` returns: (mean loss, the held-out examples scored[, metrics such as {"accuracy": ...}])."""

EvaluateFunction = Callable[[Dict[str, np.ndarray], Dict[str, Any]], EvaluateResult]
"""``evaluate(weights, config)``: scores the global model on the site's held-out examples."""

log = logging.getLogger("estuary")


class SiteError(RuntimeError):
    """The site gave up: bad TLS files, a server whose certificate fails the check, a refused model.

    Its message is the agent's one line.
    """


class _FitFailed(Exception):
    """fit raised: the round's update is withheld (its message goes to the agent's log)."""


def _evaluation_of(result: Any) -> Tuple[float, int, Optional[float]]:
    """evaluate's result as the C++ side takes it: (loss, examples, accuracy or None)."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise TypeError("evaluate must return (loss, num_examples) or (loss, num_examples, metrics), "
                        f"not {type(result).__name__}")
    loss = float(result[0])
    examples = int(result[1].item() if hasattr(result[1], "item") else result[1])
    metrics = dict(result[2]) if len(result) == 3 else {}
    if not np.isfinite(loss):
        raise ValueError(f"evaluate returned a loss of {loss}")
    if examples <= 0:
        raise ValueError(f"evaluate returned num_examples = {examples}: a score's weight is the examples it scored")
    accuracy = metrics.get("accuracy")
    if accuracy is not None:
        accuracy = float(accuracy)
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"evaluate returned an accuracy of {accuracy}, outside [0, 1]")
    return loss, examples, accuracy


@dataclasses.dataclass
class RunResult:
    """How a site's run went, once the server announced the federation complete."""

    rounds_trained: int
    """Rounds whose update was sent."""
    failures: List[Tuple[int, str]]
    """(round, one-line message) of every round whose ``fit`` raised: its update was withheld."""
    overhead_seconds: float
    """Seconds the SDK spent around ``fit`` (views, task, copying the result), over all rounds."""
    train_seconds: List[float]
    """Each trained round's whole call from the agent: taking the GIL, the views, ``fit``, copying its result."""
    evaluation_failures: List[Tuple[int, str]] = dataclasses.field(default_factory=list)
    """(round, one-line message) of every evaluation round whose ``evaluate`` raised: reported as failed."""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _update_of(result: Any, received: Mapping[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], int, Dict[str, float]]:
    """fit's result as the C++ side takes it: float32 C-contiguous arrays, an int, floats."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise TypeError("fit must return (weights, num_examples) or (weights, num_examples, metrics), "
                        f"not {type(result).__name__}")
    weights, examples = result[0], result[1]
    metrics = result[2] if len(result) == 3 else {}
    if not isinstance(weights, Mapping):
        raise TypeError(f"fit returned weights of type {type(weights).__name__}, not a mapping of names to arrays")
    arrays: Dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if name not in received:
            if dtype_name(name, value) in ("F32", "BF16", "F16", "F64"):
                raise ValueError(f"fit returned tensor '{name}', which the global model does not hold")
            continue  # an integer buffer (BatchNorm's num_batches_tracked): it stays at the site
        array = as_float32(value)
        want = received[name].shape
        if array.shape != want and not (array.ndim == 0 and want == (1,)):  # a 0-d tensor travels as [1]
            raise ValueError(f"fit returned tensor '{name}' of shape {list(array.shape)}, the global model's is "
                             f"{list(want)}")
        arrays[str(name)] = array
    missing = [name for name in received if name not in arrays]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"fit returned no tensor '{missing[0]}'{more}")
    examples = int(examples.item() if hasattr(examples, "item") else examples)
    if examples <= 0:
        raise ValueError(f"fit returned num_examples = {examples}: an update's weight is the examples it trained on")
    metrics = {str(k): float(v) for k, v in dict(metrics).items()}
    steps = metrics.get("local_steps")
    if steps is not None and not (steps >= 1 and steps == int(steps)):
        raise ValueError(f"fit returned metrics['local_steps'] = {steps:g}: expected a whole number >= 1 (the "
                         "optimizer steps it took)")
    return arrays, examples, metrics


class Client:
    """One site of a federation: its server, its certificate from the federation's CA.

    ``server`` is HOST:PORT; ``cert``, ``key`` and ``ca`` are the PEM files
    ``estuary-server certs`` issued; ``crl`` the CA's revocation list, if any.
    ``expected_model`` is a model name (``estuary.model_name``) or a state
    dict to take it from: a round of another model is refused in one line and
    ``run`` raises SiteError with it. ``num_examples`` is announced to the
    server when the site connects: a secure-aggregation round (``serve
    --secagg``) weighs the site by it; otherwise each update's weight is what
    ``fit`` returns. ``max_backoff_s`` bounds the waits between reconnects.
    """

    def __init__(self, server: str = "127.0.0.1:7443", cert: Union[str, os.PathLike] = "",
                 key: Union[str, os.PathLike] = "", ca: Union[str, os.PathLike] = "",
                 crl: Optional[Union[str, os.PathLike]] = None,
                 expected_model: Optional[Union[str, StateDict]] = None, num_examples: int = 0,
                 max_backoff_s: float = 30.0) -> None:
        self.server = server
        self.cert, self.key, self.ca = os.fspath(cert), os.fspath(key), os.fspath(ca)
        self.crl = os.fspath(crl) if crl is not None else ""
        if expected_model is not None and not isinstance(expected_model, str):
            expected_model = model_name(expected_model)
        self.expected_model = expected_model or ""
        self.num_examples = int(num_examples)
        self.max_backoff_s = float(max_backoff_s)

    def run(self, fit: FitFunction, evaluate: Optional[EvaluateFunction] = None) -> RunResult:
        """Trains every round this site is chosen for until the server says the federation is complete.

        ``fit(weights, config)`` gets the global model's floating-point tensors
        as read-only float32 arrays (views of what the agent received: copy
        what you change, e.g. ``module.load_state_dict({k: torch.tensor(v)
        ...}, strict=False)`` or ``estuary.load_weights``) and the round's
        task (model, round, site, epochs, batch_size, learning_rate, momentum,
        weight_decay, optimizer, max_local_steps, max_local_seconds,
        proximal_mu, seed). It returns (weights, num_examples[, metrics]):
        arrays or torch tensors of any float dtype, by name; integer buffers
        the server does not send are dropped. ``metrics["loss"]`` goes to the
        server's round log; ``metrics["local_steps"]``, the optimizer steps
        fit took, lets FedNova weigh the update by its work (stop after the
        step that crosses ``config["max_local_seconds"]`` when it is set).

        ``evaluate(weights, config)``, when given, answers the server's
        evaluation rounds (``serve --evaluate-every N``): it scores the global
        model on examples the site holds out from training and returns (mean
        loss, examples scored[, {"accuracy": ...}]); the server averages the
        sites' figures weighted by their examples. Without it the site says it
        does not evaluate.

        An exception in ``fit`` withholds that round's update: the site tells
        the server why (recorded ``failed`` with the line), carries on, and
        the round is listed in the result's ``failures``; one in ``evaluate``
        is reported as a failed evaluation and listed in
        ``evaluation_failures``. Raises SiteError when the site gives up.
        Ctrl-C stops the process at once.
        """
        failures: List[Tuple[int, str]] = []
        evaluation_failures: List[Tuple[int, str]] = []

        def call(weights: Dict[str, np.ndarray], config: Dict[str, Any]):
            try:
                return _update_of(fit(weights, config), weights)
            except Exception as error:  # the agent withholds the round's update
                line = _one_line(error)
                failures.append((int(config["round"]), line))
                log.error("round %d: fit raised", config["round"], exc_info=True)
                raise _FitFailed(f"fit raised {line}") from None

        def evaluate_call(weights: Dict[str, np.ndarray], config: Dict[str, Any]):
            try:
                return _evaluation_of(evaluate(weights, config))  # type: ignore[misc]
            except Exception as error:  # the agent reports a failed evaluation
                line = _one_line(error)
                evaluation_failures.append((int(config["round"]), line))
                log.error("round %d: evaluate raised", config["round"], exc_info=True)
                raise _FitFailed(f"evaluate raised {line}") from None

        # The agent holds the main thread without the GIL, so Python could not
        # act on SIGINT until the federation ends: let it end the process.
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            out = _estuary.run_site(self.server, self.cert, self.key, self.ca, self.crl, self.expected_model,
                                    self.max_backoff_s, self.num_examples, call,
                                    evaluate_call if evaluate is not None else None)
        finally:
            if restore is not None:
                signal.signal(signal.SIGINT, restore)
        if not out["ok"]:
            raise SiteError(out["error"])
        return RunResult(int(out["rounds_trained"]), failures, float(out["overhead_seconds"]),
                         [float(t) for t in out["train_seconds"]], evaluation_failures)


def load_weights(module: Any, weights: Mapping[str, np.ndarray]) -> None:
    """Copies received weights into a torch module's parameters and buffers of those names, in their dtypes.

    Integer buffers (which the server does not send) keep their values.
    """
    import torch

    state = module.state_dict()
    with torch.no_grad():
        for name, array in weights.items():
            if name not in state:
                raise KeyError(f"the federation's tensor '{name}' is not in this module's state dict")
            target = state[name]
            with warnings.catch_warnings():
                # from_numpy warns of a read-only array; copy_ only reads it.
                warnings.simplefilter("ignore", UserWarning)
                source = torch.from_numpy(np.asarray(array))
            target.copy_(source.reshape(target.shape))


__all__ = ["Client", "RunResult", "SiteError", "FitFunction", "FitResult", "EvaluateFunction", "EvaluateResult",
           "load_weights"]

"""Estuary's Python SDK: a site that trains your own PyTorch (or NumPy) model in a federation.

    import estuary

    def fit(weights, config):
        # weights: name -> read-only float32 array of the global model; config: the round's task
        ...
        return new_weights, num_examples, {"loss": loss}

    estuary.Client(server="host:7443", cert="site.pem", key="site.key", ca="ca.pem").run(fit)

The server is ``estuary-server serve --initial-model FILE.safetensors`` (write
the file with ``estuary.save_model``). ``estuary.Simulation`` runs many sites
of one model in this process against a local server. docs/PYTHON.md.
"""

from ._client import (Client, EvaluateFunction, EvaluateResult, FitFunction, FitResult, RunResult, SiteError,
                      load_weights)
from ._model_files import load_model, model_name, save_model
from ._local_server import LocalServer, ServerError, find_server
from ._simulation import Simulation, SimulationError, SimulationResult, Site

__all__ = [
    "Client", "EvaluateFunction", "EvaluateResult", "FitFunction", "FitResult", "RunResult", "SiteError",
    "load_weights", "load_model", "model_name", "save_model", "LocalServer", "ServerError", "find_server", "Simulation", "SimulationError", "SimulationResult",
    "Site",
]

"""Many sites of your own model in one process, for quick experiments.

Estuary has no in-process server a Python program can drive, so a
Simulation runs the real one as a child process (LocalServer: certificates
from ``estuary-server certs`` in a scratch directory, ``estuary-server serve
--initial-model`` on 127.0.0.1) and every site as a thread of this process,
over mutual TLS, through the same ``Client`` a deployed site uses. The
agents run without the GIL, so only the sites' ``fit`` calls take turns.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from ._client import Client, FitFunction, RunResult
from ._local_server import LocalServer, ServerError
from ._model_files import StateDict


class SimulationError(RuntimeError):
    """The server or a site failed; the message says which, with the end of the server's log."""


@dataclasses.dataclass
class Site:
    """One simulated site: its fit function and the examples it announces."""

    fit: FitFunction
    num_examples: int = 0


@dataclasses.dataclass
class SimulationResult:
    model: Dict[str, Any]
    """The last round's global model (``estuary-server export``), as ``load_model`` reads it."""
    rounds: List[Dict[str, Any]]
    """The round log, one dict a round (``estuary-server rounds list --json``): train_loss, updates, ..."""
    sites: List[RunResult]
    """Each site's run, in the order given."""
    workdir: Path
    """Certificates, the initial model, the round log, the export and server.log (gone unless kept)."""


class Simulation:
    """A federation of ``sites`` on this machine, from ``initial_model`` (a state dict, a module, or a file).

    ``sites`` are Site objects or bare fit functions. Each round samples
    ``clients_per_round`` of them (default: all), sends the task (``epochs``,
    ``batch_size``, ``learning_rate``, ``seed``) and folds the updates with
    ``strategy`` (any the server takes for a custom model: fedavg, fedadam,
    median, ...). ``server_flags`` are more ``estuary-server serve`` flags.
    The scratch directory is ``workdir``, or a temporary one removed after
    ``run`` unless ``keep_workdir``.
    """

    def __init__(self, initial_model: Union[StateDict, str, os.PathLike], sites: Sequence[Union[Site, FitFunction]],
                 rounds: int, clients_per_round: Optional[int] = None, epochs: int = 1, batch_size: int = 32,
                 learning_rate: float = 0.01, strategy: str = "fedavg", seed: int = 1,
                 round_deadline_s: float = 120.0, server_flags: Sequence[str] = (),
                 workdir: Optional[Union[str, os.PathLike]] = None, keep_workdir: bool = False,
                 server_binary: Optional[str] = None) -> None:
        if not sites:
            raise ValueError("a simulation needs at least one site")
        self.initial_model = initial_model
        self.sites = [s if isinstance(s, Site) else Site(s) for s in sites]
        self.rounds = int(rounds)
        self.clients_per_round = clients_per_round
        self.flags = ["--epochs", str(epochs), "--batch", str(batch_size), "--lr", repr(float(learning_rate)),
                      "--strategy", strategy, "--seed", str(seed), "--round-deadline",
                      repr(float(round_deadline_s))] + list(server_flags)
        self.workdir = Path(workdir) if workdir is not None else None
        self.keep_workdir = keep_workdir or workdir is not None
        self.server_binary = server_binary

    def run(self, timeout_s: Optional[float] = None) -> SimulationResult:
        """Runs the federation to its last round; raises SimulationError if the server or a site fails."""
        work = self.workdir or Path(tempfile.mkdtemp(prefix="estuary-sim-"))
        try:
            return self._run(work, timeout_s)
        finally:
            if not self.keep_workdir:
                shutil.rmtree(work, ignore_errors=True)

    def _run(self, work: Path, timeout_s: Optional[float]) -> SimulationResult:
        names = [f"site-{k}" for k in range(len(self.sites))]
        try:
            server = LocalServer(work, self.initial_model, names, self.rounds, self.clients_per_round, self.flags,
                                 self.server_binary).start()
        except ServerError as error:
            raise SimulationError(str(error)) from None
        results: List[Optional[RunResult]] = [None] * len(self.sites)
        errors: List[str] = []

        def run_site(k: int) -> None:
            client = Client(server.address, **server.site_files(names[k]), num_examples=self.sites[k].num_examples,
                            max_backoff_s=1.0)
            try:
                results[k] = client.run(self.sites[k].fit)
            except Exception as error:  # SiteError, or a bug: reported with the others
                errors.append(f"{names[k]}: {error}")

        with server:
            # Daemons: should the server die, its sites reconnect until this process ends.
            threads = [threading.Thread(target=run_site, args=(k,), daemon=True, name=names[k])
                       for k in range(len(self.sites))]
            for t in threads:
                t.start()
            try:
                server.wait(timeout_s)
            except ServerError as error:
                raise SimulationError(str(error)) from None
            # The server announced completion to every site before it exited.
            deadline = time.monotonic() + 60
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        if errors or any(t.is_alive() for t in threads):
            raise SimulationError("; ".join(errors) or "a site did not finish after the server completed")
        return SimulationResult(server.export(), server.rounds(), [r for r in results if r is not None], work)


__all__ = ["Simulation", "SimulationError", "SimulationResult", "Site"]

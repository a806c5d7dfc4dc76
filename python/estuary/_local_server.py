"""estuary-server on this machine, for simulations, examples and tests.

LocalServer creates a CA, the server's certificate and one per site with
``estuary-server certs`` in a directory, and runs ``estuary-server serve
--initial-model`` on 127.0.0.1 (a free port) as a child process, which exits
after its last round. Sites connect over mutual TLS with ``site_files``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from ._model_files import StateDict, load_model, save_model


class ServerError(RuntimeError):
    """estuary-server failed; the message holds its one line or the end of its log."""


def find_server() -> str:
    """estuary-server: $ESTUARY_SERVER, else the build tree this package was built in, or the prefix it
    was installed into (cmake --install), else PATH."""
    if os.environ.get("ESTUARY_SERVER"):
        return os.environ["ESTUARY_SERVER"]
    here = Path(__file__).resolve().parent
    built = here.parents[1] / "server" / "estuary-server"  # build/python/estuary -> build
    if built.exists():
        return str(built)
    try:
        from ._installed import SERVER  # only in an installed package
        installed = (here / SERVER).resolve()
        if installed.exists():
            return str(installed)
    except ImportError:
        pass
    found = shutil.which("estuary-server")
    if not found:
        raise ServerError("no estuary-server: set ESTUARY_SERVER, or put it on PATH")
    return found


class LocalServer:
    """A federation server in ``workdir`` for the sites ``site_names``.

    ``initial_model`` is a state dict, a module or a safetensors file;
    ``flags`` are ``estuary-server serve`` flags beyond the listen address,
    TLS files, round log, --initial-model, --rounds, --clients-per-round
    (default: every site), --min-clients (every site) and --exit-when-done.
    """

    def __init__(self, workdir: Union[str, os.PathLike], initial_model: Union[StateDict, str, os.PathLike],
                 site_names: Sequence[str], rounds: int, clients_per_round: Optional[int] = None,
                 flags: Sequence[str] = (), server_binary: Optional[str] = None) -> None:
        self.workdir = Path(workdir)
        self.binary = server_binary or find_server()
        self.site_names = list(site_names)
        self.certs = self.workdir / "certs"
        self.db = self.workdir / "rounds.db"
        self.log = self.workdir / "server.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        for args in [["init"], ["issue", "--name", "server"]] + [["issue", "--name", n] for n in self.site_names]:
            self._command(["certs", args[0], "--dir", str(self.certs)] + args[1:])
        if isinstance(initial_model, (str, os.PathLike)):
            self.model_file = Path(initial_model)
        else:
            self.model_file = self.workdir / "initial.safetensors"
            save_model(self.model_file, initial_model)
        self.args = ["serve", "--listen", "127.0.0.1:0", "--cert", str(self.certs / "server.pem"), "--key",
                     str(self.certs / "server.key"), "--ca", str(self.certs / "ca.pem"), "--db", str(self.db),
                     "--initial-model", str(self.model_file), "--rounds", str(rounds), "--clients-per-round",
                     str(clients_per_round or len(self.site_names)), "--min-clients", str(len(self.site_names)),
                     "--exit-when-done"] + list(flags)
        self.process: Optional[subprocess.Popen] = None
        self.port = 0

    def _command(self, args: List[str]) -> str:
        done = subprocess.run([self.binary] + args, capture_output=True, text=True)
        if done.returncode != 0:
            raise ServerError(f"estuary-server {' '.join(args[:2])}: {done.stderr.strip()}")
        return done.stdout

    def start(self) -> "LocalServer":
        """Starts the server; returns once it listens (self.address)."""
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([self.binary] + self.args, stdout=subprocess.PIPE, stderr=log, text=True)
        out = self.process.stdout
        for line in out:
            if line.startswith("listening on "):
                self.port = int(line.strip().rsplit(":", 1)[1])

                def drain() -> None:  # the rest of its output, until it exits
                    out.read()
                    out.close()

                threading.Thread(target=drain, daemon=True).start()
                return self
        out.close()
        self.process.wait()
        raise ServerError(f"estuary-server exited before listening:\n{self.log_tail()}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def site_files(self, name: str) -> Dict[str, Path]:
        """The keyword arguments of ``estuary.Client`` for site ``name``: cert, key and ca."""
        return {"cert": self.certs / f"{name}.pem", "key": self.certs / f"{name}.key", "ca": self.certs / "ca.pem"}

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Waits for the server to exit after its last round; raises ServerError if it failed or took too long."""
        assert self.process is not None, "start() first"
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ServerError(f"the federation took over {timeout_s} s:\n{self.log_tail()}") from None
        if code != 0:
            raise ServerError(f"estuary-server exited with {code}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Kills the server if it still runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def export(self, round: Optional[int] = None, as_torch: bool = False) -> Dict[str, Any]:
        """A committed round's model (default: the last), by ``estuary-server export``, as ``load_model`` reads it."""
        out = self.workdir / f"export-{round or 'last'}"
        self._command(["export", "--db", str(self.db), "--out", str(out)] + (["--round", str(round)] if round else []))
        return load_model(out / "model.safetensors", as_torch=as_torch)

    def rounds(self) -> List[Dict[str, Any]]:
        """The round log, one dict a round (``estuary-server rounds list --json``)."""
        return json.loads(self._command(["rounds", "list", "--db", str(self.db), "--json"]))

    def round(self, number: int) -> Dict[str, Any]:
        """One round with its participants (``estuary-server rounds show --json``)."""
        return json.loads(self._command(["rounds", "show", str(number), "--db", str(self.db), "--json"]))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "LocalServer":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["LocalServer", "ServerError", "find_server"]

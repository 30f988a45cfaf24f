"""`jaxseek serve --role prefill`: a prefill engine on a host (and mesh) of its own, serving the decode engine of a
`jaxseek serve --prefill-address HOST:PORT` elsewhere (`serving.api.disagg.DisaggregatedEngine`).

It loads its checkpoint at start (the prefill part alone with `--pd-split asymmetric`) and listens on
`--host`/`--port` for a decode engine's link (`serving.api.prefill_link`, authenticated by `$JAXSEEK_PD_KEY`).
A decode engine that connects sends its settings and its model's config: the prefill server refuses a model
other than its own (or whose prefill part its own is not) and a split other than the one it loaded, builds its
prefill engine under those settings on its own `--mesh` (kept for the next link with the same settings), and then
prefills that engine's requests until the link ends. It serves one decode engine at a time; another that connects
meanwhile is told so."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from multiprocessing.connection import Connection, Listener

from serving.api.prefill_link import keep_alive, link_key
from serving.api.prefill_worker import prefill_engine, prefill_loop, ready, weight_bytes
from sharding.mesh import MeshSpec

LOG = logging.getLogger(__name__)
HELLO_SECONDS = 60.0  # how long a new link may take to say who it is
ENDING_SECONDS = 5.0  # how long a new link waits for the last one's session to end (its decode engine closed it)


class PrefillServer:
    """The prefill engine of `model` (loaded for `split`) on `mesh` (a `MeshSpec` string, None: one device) for
    the decode engine of each link that `serve_forever` accepts on (`host`, `port`) (0: a free port; `address`
    is where it listens)."""

    def __init__(self, model, split: str, mesh: str | None, host: str = "127.0.0.1", port: int = 0):
        if mesh is not None:
            MeshSpec.parse(mesh)  # a bad spec is refused before anything listens
        self.model, self.split, self.mesh = model, split, mesh
        self.listener = Listener((host, port), authkey=link_key())
        self.address = "%s:%d" % self.listener.address
        self.engine, self.settings = None, None  # the engine built for the last link, and its settings
        self.session: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Accept links, one decode engine's at a time, until interrupted."""
        while True:
            try:
                link = self.listener.accept()
            except Exception as e:  # a wrong key, a port scan: refused, logged, the server goes on
                LOG.warning("refused a link: %s: %s", type(e).__name__, e)
                continue
            if self.session is not None:
                self.session.join(ENDING_SECONDS)
            if self.session is not None and self.session.is_alive():
                _refuse(link, f"the prefill server at {self.address} serves another decode engine")
                continue
            self.session = threading.Thread(target=self._serve, args=(link,), daemon=True, name="prefill-session")
            self.session.start()

    def _serve(self, link: Connection) -> None:
        """One decode engine's link: check what it says, build the engine, prefill until the link ends."""
        keep_alive(link)
        try:
            if not link.poll(HELLO_SECONDS):
                raise ValueError(f"the decode engine said nothing within {HELLO_SECONDS:g} s")
            kind, settings, split, model_config = link.recv()
            if kind != "hello":
                raise ValueError(f"a link must open with 'hello', got {kind!r}")
            self._check(split, model_config)
            settings = dataclasses.replace(settings, mesh=self.mesh)
            if settings != self.settings:
                self.engine, self.settings = None, None  # its buffers go before the next engine's are made
                self.engine, self.settings = prefill_engine(self.model, settings), settings
            link.send(ready(self.engine, self.model))
        except Exception as e:  # the decode side says why; this server waits for the next link
            LOG.warning("a decode engine's link failed: %s", e)
            _refuse(link, f"{type(e).__name__}: {e}")
            return
        LOG.info("prefilling for a decode engine")
        try:
            prefill_loop(link, self.engine, split)
        except Exception:  # a failed step: the link is closed, so the decode engine prefills its requests itself
            LOG.exception("the prefill engine failed; the next link gets a new one")
            self.engine, self.settings = None, None
            return
        LOG.info("the decode engine's link ended")

    def _check(self, split: str, model_config) -> None:
        if split != self.split:
            raise ValueError(f"the decode engine asks for a {split} P/D split; this prefill server loaded its "
                             f"checkpoint for a {self.split} one (--pd-split)")
        own = self.model.config
        expected = model_config.prefill_part() if split == "asymmetric" else model_config
        if expected != own:
            raise ValueError("the decode engine's model is not this prefill server's: both must load the same "
                             "checkpoint")

    def close(self) -> None:
        self.listener.close()


def _refuse(link: Connection, why: str) -> None:
    """Tell a link's decode engine why it is not served (if it still listens), and close the link."""
    try:
        link.send(("failed", why))
    except OSError:
        pass
    finally:
        link.close()


def serve_prefill(args) -> int:
    """The body of `jaxseek serve --role prefill`."""
    from model import load_model

    if args.config:
        raise ValueError("a prefill server loads a checkpoint (--model, or neither for the bundled model), not a "
                         "random --config")
    model = load_model(args.model, part="prefill" if args.pd_split == "asymmetric" else "all")
    server = PrefillServer(model, args.pd_split, args.mesh, args.host, args.port)
    print(f"jaxseek serve: prefill server on {server.address} ({args.pd_split} split, "
          f"{weight_bytes(model) / 2**20:.1f} MiB of weights, mesh {args.mesh or 'one device'}); the engine settings come from "
          "the decode engine that connects", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0

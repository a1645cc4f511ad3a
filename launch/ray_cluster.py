"""`tandem serve --launcher ray`: the three services as Ray actors, on a local cluster or a joined one.

Each actor runs the coroutine that `tandem target|draft|orchestrator` runs, on an event loop in a thread
of the actor, and reports the address it bound through an actor method. Ray only places, starts, watches
and stops the services: per-round traffic stays on their gRPC calls and streams. Ray does not restart
an actor (max_restarts=0): as the process launcher does, `tandem serve` starts a service that died (or
stopped on its own) again as a new actor at its address, with backoff (launch.restarts), and logs why;
meanwhile the orchestrator moves a dead replica's requests to the other replicas (or target-only), and
requests on a dead target wait for it. A tensor-parallel target (its ranks meet once, at start-up) is
not restarted: its death is reported and `tandem serve` exits non-zero.
TLS (`--internal-tls`, or `--tls-cert/--tls-key/--tls-ca`) reaches each actor as certificate bytes
(launch.actor_security), since an actor may run on a machine without the launcher's files.
"""

from __future__ import annotations

import math
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from launch.actor_security import ActorSecurity, ServiceSettings
from launch.processes import STARTUP_TIMEOUT_S, Interrupted, http_line, ready_line, stop_timeout_s
from launch.ray_actors import RankActor, ServiceActor, ServiceExit, rendezvous_on_this_node
from launch.ray_reservation import DRAFT_CPUS, NoRoom, Reservation, available_cpus, no_room, rank_bundle, resources
from launch.restarts import Backoff
from launch.serve_settings import ServeSettings
from launch.stack_security import StackSecurity
from tandem.settings import service_environment
from tandem.transport import TransportConfigError
from target_server.settings import TargetSettings

POLL_S = 0.2
# Everything is reserved before any service starts, after a check against the cluster's free resources, so a
# longer wait only means a cluster whose free room is split over nodes or taken meanwhile by another job.
PLACEMENT_TIMEOUT_S = 15.0


class ServiceFailed(RuntimeError):
    def __init__(self, name: str, ended: ServiceExit) -> None:
        super().__init__(f"{name} {ended.reason}")
        self.code = ended.code or 1


@dataclass(frozen=True)
class ServiceSpec:
    """What starts a service actor again where it was: its settings, address and placement."""

    settings: ServiceSettings
    host: str | None
    options: Mapping[str, object]


@dataclass
class RunningService:
    name: str
    actor: Any  # ray.actor.ActorHandle of a ServiceActor (Ray's handles are untyped)
    stopped: ray.ObjectRef[ServiceExit]  # its pending wait_until_stopped()
    spec: ServiceSpec | None = None  # None: not restarted (a target rank, a tensor-parallel target)
    port: int = 0  # the port it bound, once it serves: its restarts bind it again
    backoff: Backoff = field(default_factory=Backoff)


class RayLauncher:
    def __init__(self, settings: ServeSettings, security: ActorSecurity) -> None:
        self.settings = settings
        self.security = security  # what every service actor gets (its certificates as bytes)
        self.services: list[RunningService] = []
        self._actor_class = ray.remote(ServiceActor)
        self._rank_class = ray.remote(RankActor)
        self._placements: list[PlacementGroup] = []
        self._stopping = False
        # The orchestrator runs on this node (start): it writes its HTTP API's URL here.
        self._workdir = tempfile.TemporaryDirectory(prefix="tandem-ray-serve-")
        self.http_url = ""  # the orchestrator's HTTP API, once started with one

    def connect(self) -> None:
        address = self.settings.ray_address
        # The service environment (tandem.settings) reaches every worker of this job, on a joined cluster's other
        # nodes too; `tandem serve` has set it in its own environment (unless the user had set it).
        runtime_env = {"env_vars": service_environment()}
        # "local" always starts a new cluster, even when one started with `ray start` runs on this machine.
        if address is None:
            # Ray's counts place actors, they do not limit them: a cluster of only the CPUs this process may run
            # on could not place a stack that asks for more (tp 2 and two drafts ask for 3 on a 2-CPU machine),
            # and would wait forever. GPUs are Ray's own count: the ranks take GPU bundles only when there is one
            # per rank (rank_bundle), so they never ask for more than the machine has.
            asked = self.reservation({"CPU": 1.0}).total()["CPU"]  # the most it asks for: with CPU bundles
            num_cpus = max(available_cpus(), math.ceil(asked))
            report(
                f"starting a local Ray cluster of {num_cpus} CPUs: this process may run on {available_cpus()},"
                f" the stack asks for up to {asked:g} (Ray's counts place actors, they do not limit them)"
            )
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env=runtime_env,
            )
        else:
            ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)

    def start(self) -> str:
        """Places and starts target, drafts and orchestrator in order; returns the public address."""
        s = self.settings
        # A local cluster is this machine: services stay on loopback, as with the process launcher.
        internal_host = "127.0.0.1" if s.ray_address is None else None
        rank_options, draft_options = self._reserve()
        rendezvous = None
        if s.tp > 1:
            # The ranks meet at a free port of their node; rank 0's actor serves it. Ranks 1..tp-1 are started
            # before rank 0, so that stop() (reverse order) stops rank 0 first, which then stops them.
            probe = ray.remote(rendezvous_on_this_node).options(**rank_options[0]).remote(internal_host)
            self._wait_for([probe], "a free port on the target's node")
            rendezvous = ray.get(probe)
        target_settings = s.target_settings(rendezvous)
        for rank in range(1, s.tp):
            self._start_rank(rank, target_settings, rank_options[rank])
        target = self._start("target", target_settings, internal_host, 0, rank_options[0])
        target_address = self._wait_ready(target)
        replicas = [f"draft-{index}" for index in range(len(draft_options))]
        drafts = [
            self._start(replica, s.draft_settings(replica, target_address), internal_host, 0, options)
            for replica, options in zip(replicas, draft_options, strict=True)
        ]
        draft_addresses = [self._wait_ready(draft) for draft in drafts]
        http_ready_file = Path(self._workdir.name) / "orchestrator-http.url"
        # On loopback of this machine (the orchestrator runs here); Scale answers FAILED_PRECONDITION on Ray. With
        # --draft ngram the orchestrator's actor drafts: no draft replica is reserved or started for it.
        orchestrator_settings = s.orchestrator_settings(
            target_address, draft_addresses, s.admin_settings(), http_ready_file
        )
        # --host/--port name an address of the machine running `tandem serve`, so the orchestrator runs here.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        orchestrator_options = {"num_cpus": 0, "scheduling_strategy": here}
        orchestrator = self._start("orchestrator", orchestrator_settings, s.host, s.port, orchestrator_options)
        address = self._wait_ready(orchestrator)
        if s.http_port is not None:
            self.http_url = http_ready_file.read_text().strip()  # written before the public address
        return address

    def reservation(self, rank_bundle: Mapping[str, float]) -> Reservation:
        s = self.settings
        return Reservation(rank_bundle, s.tp, s.draft_replicas if s.draft_dir is not None else 0)

    def _reserve(self) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        """Reserves what every rank and draft replica asks for, before any starts; returns their actor options.

        Raises NoRoom, naming what was asked and what is free, when the cluster's free resources fall short or the
        placement groups are not placed within PLACEMENT_TIMEOUT_S (Ray would keep them pending forever).
        """
        reservation = self.reservation(rank_bundle(self.settings.tp))
        asked = reservation.total()
        free = ray.available_resources()
        if any(amount > free.get(name, 0.0) for name, amount in asked.items()):
            raise NoRoom(no_room(reservation, free))
        rank_options = self._placement_group([reservation.rank_bundle] * reservation.ranks, "STRICT_PACK")
        # The replicas get a group of their own, not the ranks' node: PACK prefers few nodes but takes any with room.
        draft_options = self._placement_group([{"CPU": DRAFT_CPUS}] * reservation.drafts, "PACK")
        try:
            self._wait_for([group.ready() for group in self._placements], "placement groups", PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            # The free resources sufficed in all, so they are split over nodes (or another job took them meanwhile).
            nodes = " / ".join(
                resources({name: node["Resources"].get(name, 0.0) for name in asked})
                for node in ray.nodes()
                if node["Alive"]
            )
            raise NoRoom(
                f"{no_room(reservation, ray.available_resources())}; not placed within {PLACEMENT_TIMEOUT_S:.0f} s"
                f" (the target's bundles must share one node; the nodes hold {nodes})"
            ) from None
        return rank_options, draft_options

    def _placement_group(self, bundles: Sequence[Mapping[str, float]], strategy: str) -> list[dict[str, object]]:
        """Asks Ray to place `bundles` (none: no group); returns the actor options of each bundle, in order."""
        if not bundles:
            return []
        group = placement_group([dict(bundle) for bundle in bundles], strategy=strategy)
        self._placements.append(group)
        return [
            {
                "num_cpus": bundle.get("CPU", 0.0),
                "num_gpus": bundle.get("GPU", 0.0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            }
            for index, bundle in enumerate(bundles)
        ]

    def _start_rank(self, rank: int, settings: TargetSettings, options: Mapping[str, object]) -> RunningService:
        """Target rank `rank` > 0; it joins rank 0 at settings.rendezvous and is stopped by rank 0."""
        name = f"target-rank{rank}"
        actor: Any = self._rank_class.options(max_restarts=0, max_concurrency=4, **options).remote(name, settings, rank)
        service = RunningService(name, actor, actor.wait_until_stopped.remote())
        self.services.append(service)
        return service

    def _start(
        self, name: str, settings: ServiceSettings, host: str | None, port: int, options: Mapping[str, object]
    ) -> RunningService:
        spec = ServiceSpec(settings, host, options)
        actor = self._service_actor(name, spec, port)
        # The ranks of a tensor-parallel target meet once, at start-up: such a target is not restarted.
        single = not isinstance(settings, TargetSettings) or settings.tp == 1
        service = RunningService(name, actor, actor.wait_until_stopped.remote(), spec if single else None, port)
        self.services.append(service)
        return service

    def _service_actor(self, name: str, spec: ServiceSpec, port: int) -> Any:
        # max_concurrency: wait_until_stopped() blocks for the actor's lifetime beside address() and stop().
        return self._actor_class.options(max_restarts=0, max_concurrency=4, **spec.options).remote(
            name, spec.settings, spec.host, port, self.security, self.settings.keepalive_timeout_s
        )

    def _wait_for(self, refs: Sequence[ray.ObjectRef[Any]], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Waits until every one of `refs` is ready; TimeoutError after `timeout_s`, Interrupted on a signal."""
        deadline = time.monotonic() + timeout_s
        while not self._stopping:
            _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        raise Interrupted(f"stopped while waiting for {what}")

    def _wait_ready(self, service: RunningService) -> str:
        ref = service.actor.address.remote()
        self._wait_for([ref], f"address from {service.name}")
        try:
            address: str | None = ray.get(ref)
            process: str = ray.get(service.actor.process.remote())
        except RayActorError:
            address = None
        if address is None:
            raise ServiceFailed(service.name, service_exit(service))
        service.port = int(address.rpartition(":")[2])
        # The actor logs this too, but Ray forwards actor logs late; this line is in order with the rest.
        report(f"{service.name} serving on {address} (Ray actor, {process})")
        return address

    def wait(self) -> int:
        """Blocks until a signal arrives, starting services that ended again at their addresses (with backoff);
        returns the launcher's exit code: non-zero when a service that is not restarted ends."""
        while not self._stopping:
            watched = {service.stopped: service for service in self.services}
            done, _ = ray.wait(list(watched), num_returns=1, timeout=POLL_S)
            if not done:
                continue
            service = watched[done[0]]
            ending = service_exit(service)
            if service.spec is None:
                report(f"{service.name} {ending.reason}; not restarting it")
                return ending.code or 1
            self._restart(service, ending)
        return 0

    def _restart(self, service: RunningService, ending: ServiceExit) -> None:
        """Starts a service that ended again as a new actor at its address, after its backoff; tries again (with
        longer waits) while the new one does not serve. Returns at once when a stop is asked for."""
        assert service.spec is not None
        now = time.monotonic()
        ran_s, wait_s = now - service.backoff.started, service.backoff.next_wait(now)
        report(
            f"{service.name} {ending.reason} after {ran_s:.1f} s; starting it again at its address in {wait_s:.0f} s"
        )
        ray.kill(service.actor)  # frees its place (an actor whose service ended lives on)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._stopping:
                return
            time.sleep(POLL_S)
        actor = self._service_actor(service.name, service.spec, service.port)
        service.actor, service.stopped = actor, actor.wait_until_stopped.remote()
        service.backoff.started = time.monotonic()
        try:
            self._wait_ready(service)
        except (ServiceFailed, TimeoutError) as error:
            report(f"{service.name} did not serve again: {error}")

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def stop(self) -> None:
        """Stops orchestrator, drafts, target (reverse start order), then leaves or ends the cluster."""
        for service in reversed(self.services):
            timeout_s = stop_timeout_s(service.name, self.settings.shutdown_timeout_s)
            try:
                ending: ServiceExit = ray.get(service.actor.stop.remote(), timeout=timeout_s)
            except RayActorError as error:
                ending = actor_died(error)
            except GetTimeoutError:
                ending = ServiceExit(1, f"did not stop within {timeout_s:.0f} s, killed")
            report(f"{service.name} {ending.reason}")
            ray.kill(service.actor)
        for group in self._placements:
            remove_placement_group(group)
        # Ends a cluster that connect() started; only disconnects from a joined one.
        ray.shutdown()
        self._workdir.cleanup()


def report(message: str) -> None:
    # One write per line: Ray's log thread prints forwarded actor lines to the same stream meanwhile.
    sys.stderr.write(f"tandem serve: {message}\n")
    sys.stderr.flush()


def service_exit(service: RunningService) -> ServiceExit:
    """How a service that is no longer running ended, including by its actor's death."""
    try:
        ending: ServiceExit = ray.get(service.stopped)
    except RayActorError as error:
        return actor_died(error)
    return ending


def actor_died(error: RayActorError) -> ServiceExit:
    return ServiceExit(1, f"died with its Ray actor ({str(error).splitlines()[0]})")


def read_security(settings: ServeSettings) -> ActorSecurity:
    """The stack's certificates, read here: the user's files, or throwaway ones made in a directory removed at once
    (the actors write their own copies). TransportConfigError names a file that cannot be read."""
    with tempfile.TemporaryDirectory(prefix="tandem-serve-") as workdir:
        return ActorSecurity.of(StackSecurity.prepare(settings.security, Path(workdir)))


def serve_on_ray(settings: ServeSettings) -> int:
    try:
        security = read_security(settings)
    except TransportConfigError as error:
        report(f"cannot start: {error}")
        return 2
    launcher = RayLauncher(settings, security)
    try:
        launcher.connect()
    except ConnectionError as error:
        report(f"cannot reach the Ray cluster at {settings.ray_address}: {error}")
        return 1
    # After ray.init, which installs a SIGTERM handler of its own for the driver.
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    try:
        address = launcher.start()
        if launcher.http_url:
            print(http_line(launcher.http_url), flush=True)  # before the ready line, which tools wait for
        print(ready_line(settings, address, f"{len(launcher.services)} Ray actors"), flush=True)
        return launcher.wait()
    except NoRoom as error:
        report(str(error))
        return 1
    except ServiceFailed as error:
        return error.code  # stop() below reports each service, this one with why it ended
    except Interrupted:
        return 0
    finally:
        launcher.stop()

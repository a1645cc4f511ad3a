"""Transport security of services started as Ray actors (`tandem serve --launcher ray`).

The process launcher hands its children certificate paths (`StackSecurity.tls_arguments`). An actor may run on
another machine, where those files are not, so the Ray launcher sends their contents (`CertificatePems`) with the
actor's arguments; each actor writes them into its own private directory (0700, files 0600) and from there
secures its service exactly as `tandem target|draft|orchestrator --tls-cert --tls-key --tls-ca` would:

- target and draft replicas serve mutual TLS (client certificates required);
- channels between services (draft to target, orchestrator to target and drafts) present the certificate and check
  the peer's against the CA, and against `server_name` instead of the address dialled when one is set: services on
  other machines bind their node's address, which a certificate made beforehand cannot name;
- the orchestrator's public (and admin) port serves TLS with the certificate when `public_tls`, else plaintext
  (`--internal-tls`: nobody outside the stack trusts its CA).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from draft_server.settings import DraftSettings
from launch.stack_security import StackSecurity
from orchestrator.settings import OrchestratorSettings
from tandem.certificates import INTERNAL_NAME, CertificatePems
from tandem.serving import ListenSettings
from tandem.transport import Insecure, Tls, internal_security, read_pem
from target_server.settings import TargetSettings

ServiceSettings = TargetSettings | DraftSettings | OrchestratorSettings


@dataclass(frozen=True)
class ActorSecurity:
    certificates: CertificatePems | None = None  # None: plaintext between the services and on the public port
    public_tls: bool = False  # the public and admin ports serve TLS with the certificate
    server_name: str | None = None  # what peers' certificates must name (None: the address dialled)

    @staticmethod
    def of(stack: StackSecurity) -> ActorSecurity:
        """Reads the stack's certificate files (on the launcher's machine); TransportConfigError, naming the flag and
        the file, for one that cannot be read."""
        files = stack.files
        if files is None:
            return ActorSecurity()
        certificates = CertificatePems(
            ca=read_pem(files.ca, "--tls-ca"),
            cert=read_pem(files.cert, "--tls-cert"),
            key=read_pem(files.key, "--tls-key"),
        )
        # Throwaway certificates name INTERNAL_NAME (tandem.certificates): checked for it wherever a service runs.
        server_name = INTERNAL_NAME if stack.settings.internal_tls else stack.settings.tls_server_name
        return ActorSecurity(certificates, stack.public_tls, server_name)

    def secure(
        self, settings: ServiceSettings, listen: ListenSettings, directory: Path
    ) -> tuple[ServiceSettings, ListenSettings]:
        """`settings` and `listen` with this security, its files written into `directory` (private to the actor)."""
        if self.certificates is None:
            return settings, listen
        files = self.certificates.write(directory)
        serving = internal_security(files.cert, files.key, files.ca)
        dialling = serving.with_server_name(self.server_name)
        if isinstance(settings, OrchestratorSettings):
            public = Tls(files.cert, files.key) if self.public_tls else Insecure()
            return replace(settings, internal_security=dialling), replace(listen, security=public)
        if isinstance(settings, DraftSettings):
            settings = replace(settings, target_security=dialling)
        return settings, replace(listen, security=serving)

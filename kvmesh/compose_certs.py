"""`python -m kvmesh.compose_certs FOLDER [--owner UID]`: the TLS files of docker-compose's
stack, as `kvmesh up --tls` makes its own (deploy/compose.tls.yaml's one-shot `tls-certs` step).

The same layout and names: the stack's CA (ca.pem, ca-key.pem) and NAME.pem / NAME-key.pem for
every service of kvmesh up's plan but the OpenAI door (a client of the gateway: the CA is
enough) and for the operator. In containers a service is reached by its compose service name,
so that name is in its certificate (with 127.0.0.1 and localhost, for the health check run
inside the container), and a worker's mesh name is the address it advertises there
(prefill-0:50061). Files already there are kept, so a restarted stack keeps its certificates.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvmesh.mesh_auth import OPERATOR_MEMBER_NAME, MeshRole, certificate_name
from kvmesh.stack import StackOptions, certificate_subject, plan_stack
from kvmesh.tls import StackAuthority

LOCAL_HOSTS = ("127.0.0.1", "localhost")


def compose_certificates(folder: Path) -> list[str]:
    """Issues into `folder` every certificate compose's stack needs that is not there yet;
    the names of those issued."""
    authority = StackAuthority.open(folder)
    wanted = {
        service.name: (
            certificate_subject(replace(service, host=service.name)),
            [service.name, *LOCAL_HOSTS],
        )
        # compose runs split prefill and decode pools, not kvmesh up's colocated default
        for service in plan_stack(StackOptions(mode="disaggregated", host="0.0.0.0"))
    }
    operator = certificate_name(MeshRole.OPERATOR, OPERATOR_MEMBER_NAME)
    wanted[OPERATOR_MEMBER_NAME] = (operator, list(LOCAL_HOSTS))
    issued = []
    for file_name, (subject, hosts) in wanted.items():
        if not (folder / f"{file_name}.pem").exists():
            authority.issue(file_name, subject, hosts)
            issued.append(file_name)
    return issued


def hand_over(folder: Path, owner: int) -> None:
    """Gives the folder and its files to `owner`: the services' user in the image reads its
    key (mode 0600) through the bind mount."""
    for path in [folder, *folder.iterdir()]:
        os.chown(path, owner, owner)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("folder", type=Path, help="where the CA and certificates are written")
    parser.add_argument(
        "--owner", type=int, help="uid (and gid) the files are given to (needs root)"
    )
    args = parser.parse_args(argv)
    try:
        issued = compose_certificates(args.folder)
        if args.owner is not None:
            hand_over(args.folder, args.owner)
    except OSError as error:
        print(f"kvmesh.compose_certs: {error}", file=sys.stderr)
        return 1
    print(f"kvmesh: TLS files in {args.folder}; issued: {', '.join(issued) or 'none (all kept)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

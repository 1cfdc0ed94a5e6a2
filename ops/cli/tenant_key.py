"""``kinfer tenant-key``: a tenant's request-signing key, derived from the deployment's signing secret."""

from __future__ import annotations

import argparse
import re

from kinfer.ops.cli.common import Command


def add_arguments(tk: argparse.ArgumentParser) -> None:
    tk.add_argument("--tenant", required=True, help="the tenant's name, as in the tenants file")
    tk.add_argument("--key-version", type=int, default=1,
                    help="the tenant's key_version in the tenants file [%(default)s]")


def run(args: argparse.Namespace) -> int:
    from kinfer.topics.auth import TenantCredential, signing_secrets
    from kinfer.topics.names import TENANT_PATTERN

    secrets = signing_secrets()
    if not secrets:
        raise ValueError("KINFER_SIGNING_SECRET is not set (the deployment's signing secret, hex; "
                         "`kinfer stack env --principal kinfer-gateway` shows a secure local stack's)")
    if not re.match(TENANT_PATTERN, args.tenant):
        raise ValueError(f"--tenant must match {TENANT_PATTERN}")
    print(TenantCredential.derive(secrets[0], args.tenant, args.key_version))
    return 0


COMMAND = Command("tenant-key", "print a tenant's request-signing key (from KINFER_SIGNING_SECRET), "
                                "for its KINFER_TENANT_KEY", add_arguments, run)

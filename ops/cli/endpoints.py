"""Where a command's Kafka and Redis are, and whose credentials it uses there.

``KINFER_BOOTSTRAP`` / ``KINFER_REDIS_URL`` (and ``KINFER_KAFKA_*``) when the environment gives them; a
secure local stack (``kinfer stack up --secure``) adds its principal's credentials to an environment
that names only the stack, and gives both endpoints to one that names neither. The local stack's module
is imported only when a command connects (or manages the stack): ``kinfer plan``, ``--help`` and the
like never load it.
"""

from __future__ import annotations


def take_principal(principal: str) -> None:
    """This process (and the processes it starts) acts as ``principal`` on a secure local stack, where
    the environment carries no credentials of its own; nothing happens without one."""
    from kinfer.ops.localstack.stack import apply_stack_env

    apply_stack_env(principal)


def endpoints() -> tuple[str, str]:
    """(bootstrap, redis_url) for a command that connects: the environment's, else the local stack's;
    as the principal the command took before it ran (``take_principal``), or as admin where it took none."""
    from kinfer.ops.localstack.stack import resolve_endpoints

    return resolve_endpoints()

"""What the services and the engine must agree on, in the one place each is defined.

The block-hash chain (names KV blocks on the wire and in every prefix cache), the sampling
bounds and the deterministic-request rule, structured-output constraints, the tokenizer and
where a model's files are. The modules here import no gRPC, no protobuf at run time, no torch
and no service, and of the rest of kvmesh only kvmesh.errors (plain Python), so that the engine
may import them too: they are the only part of `kvmesh` it may (pyproject.toml,
[tool.importlinter]).
"""

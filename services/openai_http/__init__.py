"""The OpenAI-compatible HTTP door: OpenAI's REST API in front of the admission gateway.

A separate service that translates each HTTP request into `Gateway.Generate` calls on the
gateway's public gRPC port and the answers back into OpenAI's bodies and Server-Sent Events;
it holds no logic of its own, so auth, budgets, priorities, shedding and the response cache
apply exactly as they do to gRPC clients.
"""

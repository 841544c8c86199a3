"""The OpenAI-compatible HTTP door: OpenAI's REST API on a second listener of the gateway.

Translates each HTTP request into requests of the gateway's own admission (the Gateway the
gRPC servicer calls, in this process) and the answers back into OpenAI's bodies and
Server-Sent Events; it holds no logic of its own, so auth, budgets, priorities, shedding and
the response cache apply exactly as they do to gRPC clients.
"""

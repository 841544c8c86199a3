"""The admission gateway: authentication, tenant limits, queues, validation, metering, the
response cache on the way in, and the router behind it."""

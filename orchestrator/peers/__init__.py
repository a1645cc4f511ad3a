"""The services the orchestrator talks to, as its step loop sees them: the target and draft backends (their interface
and their gRPC form), the pool of draft replicas with their health and demotion, DNS discovery of replicas, and
reaching a target again after it went away (recovery)."""

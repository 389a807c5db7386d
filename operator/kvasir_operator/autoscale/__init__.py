"""The builtin autoscaler: scrape the engine pods' load signals, decide, then act.

Layers, from pure to effectful: `signals` (Prometheus text -> one `PodSample` per pod and scrape),
`window` (the recent samples of the ready pods), `policy` (spec.autoscaling as a frozen value),
`history` (past recommendations, for scale-down stabilization), `decision` (the pure
`decide(...) -> Decision`), `actuator` (one reconcile tick: observe, decide, act) and `handlers`
(the thin kopf timer).
"""

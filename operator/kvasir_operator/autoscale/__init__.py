"""The builtin autoscaler: scrape the engine pods' load signals, decide, then act.

Layers, from pure to effectful: `signals` (Prometheus text -> one `PodSample` per pod and scrape),
`window` (the recent samples of the ready pods), `history` (past recommendations, for scale-down
stabilization), `decision` (the pure `decide(...) -> Decision` on the parsed
`spec.AutoscalingSpec`), `scrape` (HTTP to the pods, direct or through the pod proxy),
`actuator` (one tick: observe, decide, plan, execute) and `loop` (one task per object).
"""

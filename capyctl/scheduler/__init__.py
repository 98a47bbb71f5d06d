"""The scheduler: placement and eviction policy, ledger admission and the operations
(start, park, wake, stop, switch, reconcile) that alone change observed state."""

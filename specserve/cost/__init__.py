"""Verify-window policies: how many drafts each request verifies, and what that costs.

`policy.py` holds the contract the draft stage calls, the registry and the simple policies (`fixed`,
`confidence`); `cost_policy.py` the `cost` policy, which plans on acceptance estimates (`acceptance.py`), a
measured step-cost curve (`curve.py`) and the cost-optimal window choice (`windows.py`), guarded by an
empirical per-source gate (`gate.py`).
"""

"""Test scaffolding that a server carries only when started with --test-hooks: fault injection,
slowed engine steps, a killed engine loop, a failing route (testing/hooks.py). Nothing in the
product imports it otherwise."""

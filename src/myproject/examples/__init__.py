"""Worked examples of bringing your own code ("Bring your own model" in docs/guides/your-model.md); each is a file a user
would write, used exactly as that guide shows and run by tests/test_bring_your_own.py."""

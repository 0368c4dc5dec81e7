"""Worked examples of bringing your own code (README, "Bring your own model"); each is a file a user
would write, used exactly as the README shows and run by tests/test_bring_your_own.py."""

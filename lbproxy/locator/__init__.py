"""Geode's locator: answers over DNS (the HTTP routes are the admin app's)."""

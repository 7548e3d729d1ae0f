"""What several test modules share: seeded models, servers, checkers and waits.

Test modules import from here, never from each other."""

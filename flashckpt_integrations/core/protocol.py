"""Names shared by the saver and its clients (kept apart so that neither imports the other)."""

SOCKET_NAME = "saver.sock"
LOCK_NAME = "saver.lock"
LOG_NAME = "saver.log"
SPAWN_LOCK_NAME = "spawn.lock"
SLOTS_FILE = "slots-r{rank}.json"
"""Written by each rank: the paths of its slots, so that a saver finds snapshots it was never told of."""

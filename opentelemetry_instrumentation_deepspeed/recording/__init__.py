"""What is recorded on the training thread: the open step as plain data, and the state machine that builds it."""

"""Job scripts run by the tests (each also as a file); ``mlp_model`` is shared."""

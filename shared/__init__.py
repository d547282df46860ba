"""The wire contract shared by the API and the worker: types, names and pure rules. No I/O."""

"""The layered training engine (see ARCHITECTURE.md): runtime < model/data/observe/resilience
< parallel < checkpoint < train. Each layer imports only from layers below it."""

"""The HDF5 trace format: schema, writer and lazy reader. Imports neither the engine nor the app."""

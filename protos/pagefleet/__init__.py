"""Protocol buffers of the `pagefleet` API, by version."""

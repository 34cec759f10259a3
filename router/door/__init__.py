"""The doors of a server, over one request path (`serving`): gRPC (`server.FrontDoor`, its
messages and checks in `api`) and the OpenAI-compatible HTTP API (`http.HttpDoor`: request
bodies in `openai_protocol`, their router requests in `openai_routes`, responses in
`openai_format`, n choices merged in `choices`), both started by `doors.Doors` with the keys
and TLS of `auth`; and the Prometheus metrics both report to."""

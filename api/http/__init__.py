"""The HTTP door: the v2 protocol over HTTP/1.1, served by every API worker under uvicorn. Its
`connection` hands inference to the exchange (`batchserve.api.service`) without ASGI; every
other route goes through the Starlette `app`, described by `openapi`."""

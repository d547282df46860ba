"""`POST /v1/realtime/webhooks`: soketi says a job's channel has its first subscriber.

The workers publish a job's live events only once somebody may follow its channel (the
audience mark: a grader's job then costs soketi nothing). `POST /v1/channel-auth` sets the
mark as it signs a subscription, but a deployment may sign subscriptions in its own backend
with the app secret, as the seed product's SDK shows (`createChannelAuthorizer`). For those,
soketi's `channel_occupied` webhook sets the mark: soketi sends it as it admits the first
subscriber, before it tells that client the subscription succeeded, so before the client
starts the job. A worker that logged events unheard meanwhile sends them once it learns of
the mark (see worker/messaging/publisher.py). A subscription to an ended job's channel gets
what nobody published live, or, when that went already, the job's result again: a page
reloaded after its job ended learns how it ended (the seed product's React hook shows
nothing else for a job that expired or was lost).

Authenticated as soketi signs every webhook: `X-Pusher-Key` is the app key and
`X-Pusher-Signature` the HMAC-SHA256 of the raw body with the app secret.
"""

from __future__ import annotations

import hmac
import logging
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.body import WEBHOOKS, BodyBudget
from api.errors import ApiError
from api.state import AppState
from shared import keys
from shared.errors import FieldError, ValidationError
from shared.pusher import Webhook, webhook_signature

__all__ = ["realtime_webhooks"]

log = logging.getLogger(__name__)

# soketi batches its webhooks (SOKETI_WEBHOOKS_BATCHING, 25 ms): about 14,000 events a batch
# fit, far past what a subscribe loop makes. A batch refused for its size is lost whole,
# other subscribers' with the loop's (the sweep would mark them 2-4 s later).
MAX_WEBHOOK_BODY = 1024 * 1024
OCCUPIED = "channel_occupied"
# How far a webhook's time_ms may be from this host's clock (soketi's and ours may differ a
# little; a delivery soketi retried for longer than this was covered by the sweeper anyway).
MAX_WEBHOOK_AGE_MS = 300_000

_decoder = msgspec.json.Decoder(Webhook)


async def realtime_webhooks(request: Request) -> Response:
    state: AppState = request.app.state.coderunner
    settings = state.settings
    bodies: BodyBudget = request.app.state.request_bodies
    # (Read before the signature can be checked: counted apart, in a share of their own.)
    body = await bodies.read(request, MAX_WEBHOOK_BODY, holder=WEBHOOKS)
    key = request.headers.get("x-pusher-key", "")
    signature = request.headers.get("x-pusher-signature", "")
    expected = webhook_signature(settings.pusher_secret, body)
    if not hmac.compare_digest(key.encode(), settings.pusher_key.encode()) or not hmac.compare_digest(
        signature.encode(), expected.encode()
    ):
        raise ApiError(401, "Webhooks must carry the app key and the body's signature (X-Pusher-Key, X-Pusher-Signature)")
    try:
        webhook = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValidationError([FieldError("events", f"is not a webhook's event list ({exc})")]) from None
    except RecursionError:
        # (Skipping an unknown field nested a thousand deep recurses that far.)
        raise ValidationError([FieldError("events", "is not a webhook's event list (nested too deep)")]) from None
    if webhook.time_ms is not None and abs(time.time() * 1000 - webhook.time_ms) > MAX_WEBHOOK_AGE_MS:
        # A signed body captured once (plain-HTTP traffic, a log) is no use replayed later.
        raise ApiError(401, f"Webhooks must be fresh: time_ms is more than {MAX_WEBHOOK_AGE_MS // 1000} s away")
    # soketi batches what it sends (SOKETI_WEBHOOKS_BATCHING): a client subscribing and
    # unsubscribing in a loop puts one job's channel in a batch many times. Once is enough.
    occupied = dict.fromkeys(event.channel for event in webhook.events if event.name == OCCUPIED)
    for channel in occupied:
        job_id = keys.job_id_from_channel(channel)
        if job_id is not None and (missed := await state.store.mark_subscribed(job_id)).events:
            # The job ended before this subscription was known (nobody published it live), or
            # this is a new first subscriber of an ended job's channel (its result). Owed until
            # it went (api/sweeper.py).
            state.realtime.publish_soon(channel, missed)
    return Response(b'{"ok":true}', media_type="application/json")

"""Lists: newest first, limit 1–100 (default 10), starting_after pages through every object exactly once."""

from billing.models import Customer


def _make_customers(api, n):
    return [api.post("/v1/customers", {"email": f"c{i}@example.com"})[1]["id"] for i in range(n)]


def test_list_is_newest_first_with_default_limit_10(api):
    # Ids sort by creation millisecond (objects made in the same millisecond by their random bits).
    ids = _make_customers(api, 12)
    status, body = api.get("/v1/customers")
    assert status == 200
    assert body["object"] == "list"
    assert [row["id"] for row in body["data"]] == sorted(ids, reverse=True)[:10]
    assert body["has_more"] is True


def test_starting_after_walks_every_object_once(api):
    ids = _make_customers(api, 25)
    seen, cursor = [], None
    while True:
        params = {"limit": 7, **({"starting_after": cursor} if cursor else {})}
        _, body = api.get("/v1/customers", params)
        seen += [row["id"] for row in body["data"]]
        if not body["has_more"]:
            break
        cursor = body["data"][-1]["id"]
    assert seen == sorted(ids, reverse=True)


def test_last_page_has_no_more(api):
    ids = _make_customers(api, 3)
    _, body = api.get("/v1/customers", {"limit": 3})
    assert len(body["data"]) == 3 and body["has_more"] is False
    _, body = api.get("/v1/customers", {"starting_after": min(ids)})
    assert body == {"object": "list", "data": [], "has_more": False}


def test_limit_bounds(api):
    _make_customers(api, 2)
    assert len(api.get("/v1/customers", {"limit": 1})[1]["data"]) == 1
    assert api.get("/v1/customers", {"limit": 100})[0] == 200
    assert api.get("/v1/customers", {"limit": 101})[0] == 422
    assert api.get("/v1/customers", {"limit": 0})[0] == 422


def test_filters_combine_with_pagination(api):
    _make_customers(api, 3)
    api.post("/v1/customers", {"email": "vip@example.com", "external_id": "crm-7"})
    _, body = api.get("/v1/customers", {"external_id": "crm-7"})
    assert [row["email"] for row in body["data"]] == ["vip@example.com"]
    _, body = api.get("/v1/customers", {"email": "c1@example.com"})
    assert [row["email"] for row in body["data"]] == ["c1@example.com"]
    assert Customer.objects.count() == 4


def test_starting_after_an_unknown_id_is_404(api):
    status, body = api.get("/v1/customers", {"starting_after": "cus_" + "0" * 26})
    assert (status, body["error"]["param"]) == (404, "starting_after")


def test_starting_after_an_id_of_another_type_is_422(api):
    status, body = api.get("/v1/customers", {"starting_after": "price_" + "0" * 26})
    assert (status, body["error"]["param"]) == (422, "starting_after")

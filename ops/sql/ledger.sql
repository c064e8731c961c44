-- The doctor's checks of the credit ledger and customer balances (docs/reference/domain.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: ledger_balance_after_running_sum
-- A customer's ledger entries form one running sum from 0: taken in some order, each entry's balance_after − amount
-- is the previous entry's balance_after. Entries are ordered by the customer row lock, not by created_at (a
-- transaction's now() or a test clock's frozen time), so the check is the order-free form: every balance is left as
-- often as it is reached, except 0 (the start) and the sum (the end). It finds any lost, stale or mis-summed write;
-- it cannot see a closed loop of entries detached from the chain, which no single bad write produces.
WITH chain_end AS (
    SELECT customer_id, sum(amount) AS final FROM billing_ledgerentry GROUP BY customer_id
), step AS (
    SELECT customer_id, balance_after - amount AS balance, 1 AS leaves FROM billing_ledgerentry
    UNION ALL
    SELECT customer_id, balance_after, -1 FROM billing_ledgerentry
    UNION ALL
    SELECT customer_id, 0, -1 FROM chain_end
    UNION ALL
    SELECT customer_id, final, 1 FROM chain_end
), unbalanced AS (
    SELECT customer_id, balance, sum(leaves) AS excess FROM step
    GROUP BY customer_id, balance HAVING sum(leaves) <> 0
)
SELECT customer_id AS ref,
       'the ledger is not one running sum from 0: '
       || string_agg('balance ' || balance || CASE WHEN excess > 0 THEN ' left ' ELSE ' reached ' END
                     || abs(excess) || ' more time(s) than ' || CASE WHEN excess > 0 THEN 'reached'
                     ELSE 'left' END, ', ' ORDER BY balance) AS detail
FROM unbalanced
GROUP BY customer_id;

-- name: customer_balance_matches_ledger
-- A customer's credit_balance is where its ledger ends: the sum of its entries (0 with no entry).
SELECT c.id AS ref, 'credit_balance ' || c.credit_balance || ' but the ledger sums to '
       || coalesce(l.amount, 0) AS detail
FROM billing_customer c
LEFT JOIN (SELECT customer_id, sum(amount) AS amount FROM billing_ledgerentry GROUP BY customer_id) l
       ON l.customer_id = c.id
WHERE c.credit_balance <> coalesce(l.amount, 0);

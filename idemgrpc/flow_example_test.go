package idemgrpc_test

import (
	"context"
	"errors"
	"log"
	"net"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	pb "github.com/pgidem/idem/idemgrpc/internal/testpb" // your generated package
)

// Checkout is what the checkout flow takes; Receipt what it answers. A
// decline is part of the answer, so that every retry gets it again.
type Checkout struct {
	AmountCents int64 `json:"amount_cents"`
}

type Receipt struct {
	OrderID  int64  `json:"order_id"`
	ChargeID string `json:"charge_id"`
	Declined bool   `json:"declined,omitempty"`
}

// chargeCard stands in for the payment provider's client: it sends
// providerKey as the request's idempotency key. It returns "" for a
// decline, and an error when the outcome is not known.
func chargeCard(ctx context.Context, providerKey string, amountCents int64) (chargeID string, err error) {
	return "ch_1", nil
}

// paymentService serves the Payments service; its Pay method is a flow.
type paymentService struct {
	checkout *idem.Flow[Checkout, Receipt]
}

// Pay runs the flow for the call, under its key, and builds the response
// from the flow's answer, the same on every retry.
func (s *paymentService) Pay(ctx context.Context, req *pb.PayRequest) (*pb.Payment, error) {
	if req.GetAmountCents() <= 0 {
		return nil, status.Error(codes.InvalidArgument, "amount_cents must be positive")
	}
	out, err := idemgrpc.RunFlow(ctx, s.checkout, Checkout{AmountCents: req.GetAmountCents()})
	if err != nil {
		return nil, err // a status already: UNAVAILABLE to retry, ABORTED in progress, ...
	}
	if out.Declined {
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	}
	return &pb.Payment{Id: out.OrderID, AmountCents: req.GetAmountCents(), Status: "paid"}, nil
}

// A gRPC method whose write calls a payment provider, served as a flow:
// the interceptor lists it in Config.Flows, so that it opens no
// transaction for it, and its handler runs the flow with RunFlow. The
// order is recorded in a local step; the card is charged with no
// transaction open and no connection held, with a provider key that stays
// the same on every attempt; a resumer completes the flows whose clients
// never came back.
func ExampleRunFlow() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	checkout := idem.MustNewFlow("checkout", func(ctx context.Context, s *idem.Steps, in Checkout) (Receipt, error) {
		orderID, err := idem.Local(s, "order", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO shop_order (tenant, amount_cents) VALUES ($1, $2) RETURNING id`,
				s.Scope(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return Receipt{}, err
		}
		chargeID, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return chargeCard(ctx, providerKey, in.AmountCents)
		})
		if err != nil {
			return Receipt{}, err // uncertain: the client gets UNAVAILABLE, and its retry calls again with the same key
		}
		return Receipt{OrderID: orderID, ChargeID: chargeID, Declined: chargeID == ""}, nil
	})

	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{
		Scope: func(ctx context.Context) (string, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			if tenant := md.Get("x-tenant"); len(tenant) == 1 && tenant[0] != "" {
				return tenant[0], nil // in a real service: the authenticated caller
			}
			return "", errors.New("no tenant")
		},
		Flows: []string{pb.PaymentsPay}, // pb.Payments_Pay_FullMethodName
	})
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptor))
	s := &paymentService{checkout: checkout}
	(&pb.PaymentsServer{Pay: s.Pay}).Register(srv) // pb.RegisterPaymentsServer(srv, s)

	// Completes the flows whose clients gave up, with the same steps.
	resumer, err := idem.StartResumer(ctx, pool, idem.ResumerConfig{}, checkout)
	if err != nil {
		log.Fatal(err)
	}
	defer resumer.Stop()

	lis, err := net.Listen("tcp", "127.0.0.1:8443")
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(srv.Serve(lis))
}

package idemgrpc_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
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

// gateway stands in for a payment provider's client: it charges once per
// idempotency key, and here its first answer is lost after the charge
// went through, as a timeout loses it. A decline would be a "" charge.
type gateway struct {
	mu      sync.Mutex
	charges map[string]string // idempotency key → charge id
	lost    bool
}

func (g *gateway) Charge(ctx context.Context, idempotencyKey string, amountCents int64) (string, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	id, ok := g.charges[idempotencyKey]
	if !ok {
		id = fmt.Sprintf("ch_%d", len(g.charges)+1)
		g.charges[idempotencyKey] = id
	}
	if !g.lost {
		g.lost = true
		return "", errors.New("provider timeout") // the charge went through; its answer did not
	}
	return id, nil
}

// The Shop service, written without protoc. Its messages are protobuf's
// well-known types, which need no generated code: Pay takes the amount in
// cents (a wrapperspb.Int64Value) and answers a structpb.Struct.
// shopService describes the service to gRPC as protoc-gen-go-grpc's code
// would, and a client calls Pay with conn.Invoke and payMethod. With
// protoc, use the generated code instead: pb.RegisterShopServer(srv, s),
// pb.NewShopClient(conn), and pb.Shop_Pay_FullMethodName in Config.Flows.
const payMethod = "/shop.v1.Shop/Pay"

var shopService = grpc.ServiceDesc{
	ServiceName: "shop.v1.Shop",
	HandlerType: (*any)(nil), // the type RegisterService checks the server against
	Methods: []grpc.MethodDesc{{
		MethodName: "Pay",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			req := new(wrapperspb.Int64Value)
			if err := dec(req); err != nil {
				return nil, err
			}
			pay := func(ctx context.Context, req any) (any, error) {
				return srv.(*shopServer).Pay(ctx, req.(*wrapperspb.Int64Value))
			}
			if interceptor == nil {
				return pay(ctx, req)
			}
			return interceptor(ctx, req, &grpc.UnaryServerInfo{Server: srv, FullMethod: payMethod}, pay)
		},
	}},
}

// shopServer serves the Shop service; its Pay method is a flow.
type shopServer struct {
	checkout *idem.Flow[Checkout, Receipt]
}

// Pay runs the flow for the call, under its key, and builds the response
// from the flow's answer, the same on every retry.
func (s *shopServer) Pay(ctx context.Context, req *wrapperspb.Int64Value) (*structpb.Struct, error) {
	if req.GetValue() <= 0 {
		return nil, status.Error(codes.InvalidArgument, "the amount must be positive")
	}
	out, err := idemgrpc.RunFlow(ctx, s.checkout, Checkout{AmountCents: req.GetValue()})
	if err != nil {
		return nil, err // a status already: UNAVAILABLE to retry, ABORTED in progress, ...
	}
	if out.Declined {
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	}
	return structpb.NewStruct(map[string]any{"order_id": out.OrderID, "charge_id": out.ChargeID})
}

// A gRPC server whose Pay method calls a payment provider, served as a
// flow, and a client that calls it. The interceptor lists the method in
// Config.Flows, so that it opens no transaction for it, and the handler
// runs the flow with RunFlow: the order is recorded in a local step, and
// the card is charged with no transaction open and no connection held,
// under a provider key that stays the same on every attempt. The
// provider's first answer is lost: the call gets UNAVAILABLE, and the
// client's retry, with the same key, continues the flow, so that the
// provider charges once. A resumer completes the flows whose clients
// never came back.
func ExampleRunFlow() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	err = idem.Migrate(ctx, db)
	db.Close()
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS shop_order (
	    id           bigserial PRIMARY KEY,
	    tenant       text   NOT NULL,
	    amount_cents bigint NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}
	provider := &gateway{charges: make(map[string]string)}

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
			return provider.Charge(ctx, providerKey, in.AmountCents)
		})
		if err != nil {
			return Receipt{}, err // uncertain: the client gets UNAVAILABLE, and its retry calls again with the same key
		}
		return Receipt{OrderID: orderID, ChargeID: chargeID, Declined: chargeID == ""}, nil
	}, idem.WithGrace(time.Minute)) // a minute for the client to retry before the resumer takes the flow over

	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{
		Scope: func(ctx context.Context) (string, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			if tenant := md.Get("x-tenant"); len(tenant) == 1 && tenant[0] != "" {
				return tenant[0], nil // in a real service: the authenticated caller
			}
			return "", errors.New("no tenant")
		},
		Flows: []string{payMethod},
	})
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptor))
	srv.RegisterService(&shopService, &shopServer{checkout: checkout})

	// Completes the flows whose clients gave up, with the same steps.
	resumer, err := idem.StartResumer(ctx, pool, idem.ResumerConfig{}, checkout)
	if err != nil {
		log.Fatal(err)
	}
	defer resumer.Stop()

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.GracefulStop()

	// The client: the interceptor keeps a call's key across its retries;
	// this one sets its own, to retry by hand.
	conn, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	callCtx := metadata.AppendToOutgoingContext(ctx, "x-tenant", tenant, "idempotency-key", "cart-7")
	pay := func() {
		var header metadata.MD
		res := new(structpb.Struct)
		err := conn.Invoke(callCtx, payMethod, wrapperspb.Int64(2500), res, grpc.Header(&header))
		if err != nil {
			st := status.Convert(err)
			reason := "" // idemgrpc's errors carry an ErrorInfo: switch on its reason
			for _, d := range st.Details() {
				if info, ok := d.(*errdetails.ErrorInfo); ok {
					reason = info.GetReason()
				}
			}
			fmt.Println(st.Code(), reason)
			return
		}
		replayed := len(header.Get(idemgrpc.ReplayedMetadata)) > 0
		fmt.Printf("paid: %s, replayed %t\n", res.GetFields()["charge_id"].GetStringValue(), replayed)
	}

	pay()
	pay() // the client's retry, with the same key
	pay()
	provider.mu.Lock()
	fmt.Println("charges at the provider:", len(provider.charges))
	provider.mu.Unlock()
	// Output:
	// Unavailable OPERATION_INCOMPLETE
	// paid: ch_1, replayed false
	// paid: ch_1, replayed true
	// charges at the provider: 1
}
